"""What the `hp train` tests share: running the command, reading its results, a local HF model directory.

A run that a test expects to train runs on gloo ranks forked by the pytest
worker's zygote (`rank_pool`): the launcher's checks, then each worker's
code, without starting Python anew. A test of the launcher itself (its exit codes and
messages, signals, several nodes, a run it watches while it runs) asks for
the command (`launcher=True`, or `wait=False`, or `launch`): `python -m
hp.cli train`, with torch's elastic launcher, the command's own zygote and
its gloo workers when the strategy has more than one rank, run by a
process the test zygote forks (the interpreter's start and imports are all
it skips; tests/test_packaging.py runs the command in fresh interpreters).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import rank_pool
from gloo_launch import _free_port

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
DATA = str(ROOT / "examples" / "data")


def hp_train(*overrides: str, config: str = QUICKSTART, wait: bool = True, launcher: bool = False):
    if wait and not launcher:
        return _in_pool(config, [f"dataset_dir={DATA}", *overrides])
    run, = launch(list(overrides), config=config)
    if not wait:
        return run
    out, err = run.communicate(timeout=600)
    return subprocess.CompletedProcess(["hp", "train", config, *overrides], run.returncode, out, err)


def launch(*runs: list[str], config: str = QUICKSTART) -> list[rank_pool.Started]:
    """`hp train config dataset_dir=DATA *overrides` for each of `runs` at once, the command itself (its launcher
    and the workers its zygote forks), not waited for: `python -m hp.cli train` run by a process forked from the
    test zygote, which has imported what the command imports (what a fresh interpreter adds is
    tests/test_packaging.py's). Each runs in its output directory (made first), so that `workers` finds its
    processes by their working directory as well as by their command lines: the forked ones have the zygote's."""
    argvs, cwds = [], []
    for overrides in runs:
        out = next((o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")), None)
        assert out, f"launch runs each command in its output directory: give output_dir= in {overrides}"
        os.makedirs(out, exist_ok=True)
        master = [] if any(o.startswith("master_port=") for o in overrides) else [f"master_port={_free_port()}"]
        argvs.append(["-m", "hp.cli", "train", config, f"dataset_dir={DATA}", *master, *overrides])
        cwds.append(out)
    return rank_pool.start(argvs, cwds)


def _in_pool(config: str, overrides: list[str]) -> subprocess.CompletedProcess:
    from hp.train.config import load_config

    world = load_config(config, overrides).world_size
    return rank_pool.run(str(WORKERS / "train_in_pool.py"), world, config, *overrides)


def summary(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def losses(output_dir: Path) -> dict[int, float]:
    with open(output_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def first_batch(overrides: list[str]):
    """The global batch the first step of `hp train QUICKSTART *overrides` draws, computed here."""
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples, load_tokenizer

    config = load_config(QUICKSTART, overrides)
    tokenizer = load_tokenizer(config.model_name_or_path)
    batch = config.per_device_train_batch_size * config.parallel.dp
    return next(TokenBatches(load_examples(config, tokenizer), batch, config.seed, tokenizer.pad_token_id))


def run_cases(out: Path, world: int, cases: dict[str, list[str]], *, logits: bool = True,
              config: str = QUICKSTART) -> dict[str, tuple]:
    """`hp train config *overrides` for each case {name: overrides} in one job of `world` forked ranks
    (`workers/loaded_gloo.py`): {name: (logits on the worker's batch before any step, or None; first loss;
    the logged losses)}; `logits`: build each model once more first, to compute them (not under pp)."""
    import torch

    out.mkdir(parents=True)
    (out / "cases.json").write_text(json.dumps([{"name": n, "overrides": o, "logits": logits}
                                                for n, o in cases.items()]))
    run = rank_pool.run(str(WORKERS / "loaded_gloo.py"), world, str(out / "cases.json"), config, str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return {name: (torch.load(out / f"{name}.pt") if (out / f"{name}.pt").exists() else None, r["first"], r["losses"])
            for name, r in got.items()}


QWEN_TOKENS = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "bos": None, "eos": "<|im_end|>",
               "pad": "<|endoftext|>"}  # how Qwen's instruct tokenizers name theirs (no bos)


def local_hf_model(directory: Path, family: str = "llama", *, specials: tuple[str, ...] = ("<s>", "</s>"),
                   bos: str | None = "<s>", eos: str = "</s>", pad: str | None = None, layers: int = 2,
                   tied: bool | None = None) -> None:
    """A tiny model of `family` saved as a HF directory: config, safetensors and a locally trained BPE tokenizer.

    `tied` ties the head to the embedding (`tie_word_embeddings`; None: the family's config's default).

    `specials` are the tokenizer's special tokens after `<unk>` (Qwen's chat tokens with `**QWEN_TOKENS`); a
    vision-language family's needs Qwen's vision tokens among them (`local_vl_model`).
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedTokenizerFast

    from hp.models import VL_FAMILIES, tiny_config

    records = json.loads((Path(DATA) / "quickstart.json").read_text())
    text = [" ".join(r.values()) for r in records[:200]]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *specials]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token=bos, eos_token=eos,
                                        pad_token=pad)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(3)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) if token else None
           for name, token in (("bos", bos), ("eos", eos), ("pad", pad or "<unk>"))}
    config = tiny_config(family, layers=layers, vocab_size=320, **ids)
    if tied is not None:  # the model config's own (a vision-language one's too: transformers ties by it)
        config.tie_word_embeddings = tied
    if family not in VL_FAMILIES:
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        return
    for name, token in zip(("vision_start", "vision_end", "image", "video"), VL_TOKENS):  # the tokenizer's ids
        setattr(config, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    AutoModelForImageTextToText.from_config(config).save_pretrained(directory)


VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# A tiny Qwen3-VL's image processor, written as Qwen3-VL's own preprocessor_config.json (mean and std 0.5, the
# bounds as size) at the tiny tower's 4-pixel patches: every picture becomes 32 x 32 to 64 x 64 pixels.
TINY_QWEN3_VL_PROCESSOR = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}, "patch_size": 4,
                           "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                           "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                           "image_processor_type": "Qwen2VLImageProcessorFast"}


def local_vl_model(directory: Path, family: str = "qwen3_vl", processor: dict | None = None,
                   tied: bool | None = None) -> None:
    """A tiny vision-language model of `family` saved as a HF directory: `local_hf_model`'s, its tokenizer with
    Qwen's chat and vision tokens (the config's ids), and `processor` (default `TINY_QWEN3_VL_PROCESSOR`) as its
    preprocessor_config.json."""
    local_hf_model(directory, family, **{**QWEN_TOKENS, "specials": (*QWEN_TOKENS["specials"], *VL_TOKENS)},
                   tied=tied)
    (directory / "preprocessor_config.json").write_text(json.dumps(processor or TINY_QWEN3_VL_PROCESSOR))


def workers(marker: str) -> list[int]:
    """Live processes (other than this one) whose command line or working directory holds `marker` (Linux's
    /proc): a run's launcher forked from the test zygote, and what it forks, are found by the directory
    (`launch`), its stand-ins by their command lines too."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            where = os.readlink(entry / "cwd") if command else ""  # a zombie has neither
        except OSError:
            continue  # not a process, or one that just ended
        if entry.name.isdigit() and int(entry.name) != os.getpid() and (marker in command or marker in where):
            found.append(int(entry.name))
    return found


def assert_stopped_whole(output_dir: Path, stop: str) -> None:
    """After `stop`, no process of the run writing to `output_dir` is left within 30 s, and every checkpoint
    the run left is whole, stopped mid-save or not."""
    from hp.train import checkpoint

    deadline = time.time() + 30
    while workers(str(output_dir)) and time.time() < deadline:
        time.sleep(0.2)
    assert workers(str(output_dir)) == [], f"workers outlived the launcher after {stop}"
    for saved in output_dir.iterdir():
        if saved.name.startswith("checkpoint-") and not saved.name.endswith(".partial"):
            assert checkpoint.trainer_state(str(saved))["step"] == int(saved.name.split("-")[1]), saved


def ranks(marker: str) -> dict[int, int]:
    """{rank: pid} of the workers among the processes whose command line holds `marker`: a worker forked by the
    zygote has the zygote's command line, and its own name (`hp rank N`)."""
    found = {}
    for pid in workers(marker):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("hp rank "):
            found[int(name.split()[-1])] = pid
    return found


def worker_of_rank(marker: str, rank: int) -> int:
    """The pid of the worker of `rank` among the processes whose command line holds `marker`."""
    pid = ranks(marker).get(rank)
    assert pid is not None, f"no worker of rank {rank} found"
    return pid
