"""The data layer of `hp train`: LlamaFactory-style datasets, tokenized, and a resumable batch stream.

Users arrive with LlamaFactory configs and data directories, so the same
keys mean the same here, and the same records give the same token ids and
labels as LlamaFactory's stages (pt, sft, rm, dpo, kto), images included for
a vision-language model. Malformed data is a ValueError naming the dataset,
file and record, found before any worker starts. Its modules, from the
bottom up:

    byte_tokenizer         the embedded models' byte-level tokenizer
    embedded               the embedded tiny models (names, tokens, HF configs) and `model_config`
    tokenizer              `load_tokenizer`: the byte tokenizer, or a local HF one, as `Tokenizer`
    chat_template          a tokenizer's own Jinja chat_template read back as a template
    encoding               conversations to ids and labels with a template, as LlamaFactory's sft
    preference             rm/dpo pairs and kto answers to ids and labels
    images                 a picture file to the patches a Qwen-VL vision tower reads
    vision                 `Vision`: how a vision-language model reads a record's images
    batch                  `Batch`: examples padded into the tensors of one forward
    dataset_info           LlamaFactory's dataset_info.json: where each dataset is, how it is laid out
    records                a record as a conversation, a document, a pair or a judged answer
    tokenizing             records to examples, in this process or a pool of them
    examples               `load_examples`: the named datasets read, checked for the stage, tokenized
    splits                 `load_splits`: the training examples and the held-out ones
    stream                 `TokenBatches`, the seeded resumable stream, and `eval_batches`
    quickstart, quickstart_preference, quickstart_vl   the quickstart datasets (examples/data/)

What it may import: torch (batches are tensors; transformers and Pillow
only where a tokenizer, a model config or a picture is read), and of
hp.train only `hp.train.config` (the stages, the templates). Nothing
above it (the model, the loop, the launcher), which all read data from
here: the model builder takes the embedded models' configs from
`embedded`, not the reverse.
"""

from hp.train.data.batch import Batch, collate
from hp.train.data.byte_tokenizer import ByteTokenizer
from hp.train.data.encoding import IGNORE_INDEX, Conversation, encode_conversation, encode_prompt
from hp.train.data.examples import SFT_OPTIONS, Examples, build_examples, load_examples
from hp.train.data.splits import load_splits, split_for_eval
from hp.train.data.stream import TokenBatches, eval_batches
from hp.train.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX", "SFT_OPTIONS",
    "Batch", "ByteTokenizer", "Conversation", "Examples", "HFTokenizer", "TokenBatches", "Tokenizer",
    "build_examples", "collate", "encode_conversation", "encode_prompt", "eval_batches", "load_examples",
    "load_splits", "load_tokenizer", "split_for_eval",
]
