"""The vision-language quickstart dataset: name the colour and shape in a picture, in LlamaFactory's multimodal format.

`hp train examples/quickstart_vl.yaml` must show the embedded tiny Qwen2.5-VL
(`hp/tiny-qwen2.5-vl`: 2 decoder layers of hidden 128, a vision tower of 2
blocks of hidden 64, 4-pixel patches) learning from pictures within a few
minutes on two CPU cores. Each picture is 32 x 32 pixels: one filled shape
(square, circle or triangle) in one of four colours (red, green, blue,
yellow), of a random size and place, on white; the user asks
"<image>What is in the picture?" and the assistant answers "a red circle".
The text is the same in every record, so the answer cannot be read from it:
a model blind to the pictures can at best learn the form of the answer and
the frequency of each of the 12 colour-shape pairs, which costs their
entropy, 2.47 nats a record, 0.152 a supervised token (16.3 a record on
average: the answer, the template's <|im_end|> and newline). A loss below
that floor, on pictures held out from training, is a model that reads its
images. Each picture becomes 49 image tokens: the processor's lower pixel
bound (56 x 56) grows it to 56 x 56 pixels, 14 x 14 patches merged 2 x 2;
with LlamaFactory's qwen2_vl template and its default system prompt a
record is 145-150 tokens.

The records are laid out as LlamaFactory's `mllm_demo`: sharegpt `messages`
with role/content tags and an `images` column of paths relative to the
dataset directory. The files are seeded, so they are the same on every run;
`examples/make_quickstart_data.py vl` writes the copy in `examples/data/`
(200 records and pictures, 66 KB).

Measured with `hp train examples/quickstart_vl.yaml` (tp=2 on 2 CPU cores
that another job was using too; batch 16, lr 2e-3 with cosine decay, 100
steps, 20 records held out): loss 5.82 at step 1, 0.081 at step 100; the
held-out loss 0.175 at step 50 and 0.078 at step 100, half the floor of a
blind model; 2 minutes from the command to its summary (86 s on idle
cores without the evaluation). 150 steps took the held-out loss to 0.060.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hp.train.data.quickstart import add_to_dataset_info

NAME = "quickstart_vl"
SIZE = 32  # pixels each way
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (230, 190, 20)}
SHAPES = ("square", "circle", "triangle")
QUESTION = "<image>What is in the picture?"
# LlamaFactory's mllm_demo entry: sharegpt messages with OpenAI-style tags, and the images column
INFO = {"file_name": f"{NAME}.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}


def pictures(n: int, seed: int) -> list[tuple[str, str, tuple[int, int, int]]]:
    """`n` (colour, shape, (left, top, side)) pictures, the same for the same seed.

    >>> pictures(2, 0)
    [('yellow', 'circle', (8, 16, 12)), ('yellow', 'circle', (15, 11, 16))]
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        colour, shape, side = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.randint(12, 22)
        out.append((colour, shape, (rng.randint(0, SIZE - side), rng.randint(0, SIZE - side), side)))
    return out


def draw(colour: str, shape: str, place: tuple[int, int, int]):
    """The picture: a `colour` `shape` filling the square `place` (left, top, side) of a white canvas.

    >>> image = draw("red", "square", (0, 0, 12))
    >>> image.size, image.getpixel((5, 5)), image.getpixel((20, 20))
    ((32, 32), (220, 40, 40), (255, 255, 255))
    """
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    left, top, side = place
    right, bottom, fill = left + side - 1, top + side - 1, COLOURS[colour]
    if shape == "square":
        pen.rectangle((left, top, right, bottom), fill=fill)
    elif shape == "circle":
        pen.ellipse((left, top, right, bottom), fill=fill)
    else:
        pen.polygon([(left + (side - 1) / 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image


def record(colour: str, shape: str, image: str) -> dict:
    """One sharegpt record asking about the picture at `image` (a path relative to the dataset directory).

    >>> record("blue", "triangle", "quickstart_vl/000.png")["messages"][1]
    {'role': 'assistant', 'content': 'a blue triangle'}
    """
    return {"messages": [{"role": "user", "content": QUESTION},
                         {"role": "assistant", "content": f"a {colour} {shape}"}], "images": [image]}


def write(out_dir: Path, n: int = 200, seed: int = 0) -> Path:
    """Write the pictures (`quickstart_vl/NNN.png`), `quickstart_vl.json` (a record a line) and the
    dataset_info.json entry (other entries kept); returns the JSON file."""
    images = out_dir / NAME
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (colour, shape, place) in enumerate(pictures(n, seed)):
        name = f"{NAME}/{i:03d}.png"
        draw(colour, shape, place).save(out_dir / name, optimize=True)
        records.append(record(colour, shape, name))
    data = out_dir / INFO["file_name"]
    lines = ",\n".join(json.dumps(r) for r in records)
    data.write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    add_to_dataset_info(out_dir, NAME, INFO)
    return data
