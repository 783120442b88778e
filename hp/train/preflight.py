"""What `hp train` checks in the launching process, before any worker starts.

A mistake found by N workers costs N tracebacks and the time to start them;
found here it costs a second and one message. So whatever does not need the
workers is checked here, in the order a user would fix it: the device, the
rendezvous port, the output directory, the checkpoint to resume from, the
model directory (its tokenizer, its config, its weights' names and shapes
against that config, and a preference stage's `ref_model` alike, the strategy against the model: heads tp divides,
experts that expert parallel and the routing bias need and ep divides), the chat template
against the tokenizer (its special tokens, or the tokenizer's own
chat_template when `template` is unset), and the data (every
dataset file parses, holds the columns its template needs, fills a batch,
and leaves examples for evaluation when asked to; every image a record
names opens, is at least one patch, and fits in `cutoff_len` with as many
`<image>` placeholders as images, for a model that reads images). Each problem is a
`ConfigError` naming the key and the file or record.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from hp.train.config import RESUME_LAST, ConfigError, TrainConfig, strategy_labels


def check(config: TrainConfig) -> tuple:
    """Raise `ConfigError` for the first thing that would stop `config`'s workers; else the data's splits
    (`hp.train.data.load_splits`), which the workers need not make again.

    >>> from hp.train.config import validate
    >>> check(validate({"model_name_or_path": "hp/tiny-llama", "dataset": "nope", "output_dir": "/tmp/hp-doc"}))
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: dataset 'nope': data has no dataset_info.json and no file data/nope (name a .json/.jsonl file in dataset_dir, or add dataset_info.json)
    """
    from hp.train.data import load_tokenizer

    _check_device(config.device)
    _check_trackers(config.report_to)
    _check_port(config)
    _check_output_dir(config)
    state = _trainer_state(config)
    try:
        tokenizer = load_tokenizer(config.model_name_or_path)
    except (OSError, ValueError) as e:
        raise ConfigError(_model_words(config, e)) from None
    _check_model(config, tokenizer.vocab_size)
    _check_template(config, tokenizer)
    return _check_data(config, tokenizer, state)


def _check_trackers(report_to: tuple[str, ...]) -> None:
    if "tensorboard" in report_to:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("report_to = 'tensorboard' needs the tensorboard package, which is not installed here: "
                              "expected `pip install tensorboard` (or hp[tensorboard]), or report_to: none") from None


def _check_device(device: str) -> None:
    from hp.device import available

    found = available()
    if device not in ("auto", "cpu") and found != device:
        raise ConfigError(f"device = {device!r} is not available on this machine (found: {found})")


def _check_port(config: TrainConfig) -> None:
    """A rendezvous port chosen on one node must be free here (several nodes: node 0 listens, the others call)."""
    if config.master_port is None or config.nnodes > 1:
        return
    with socket.socket() as probe:
        try:
            probe.bind(("", config.master_port))
        except OSError as e:
            raise ConfigError(f"master_port = {config.master_port} cannot be used on this machine ({e.strerror}: "
                              "another run?); leave master_port out to pick a free port") from None


def _check_output_dir(config: TrainConfig) -> None:
    """A directory (or a path where one can be made) that is writable, and not a run nobody asked to touch."""
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir = {config.output_dir!r} is a file: expected a directory, or a path where "
                          "one can be made")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output_dir = {config.output_dir!r}: {existing} is a file, so no directory can be made there")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir = {config.output_dir!r}: {existing} is not writable")
    if out.is_dir() and any(out.iterdir()) and not (config.overwrite_output_dir or config.resume_from_checkpoint):
        raise ConfigError(
            f"output_dir = {config.output_dir!r} already holds a run; set overwrite_output_dir: true to start over "
            "or resume_from_checkpoint: last to continue it"
        )


def resume_path(config: TrainConfig, skipped: list[tuple[str, str]] | None = None) -> str | None:
    """The checkpoint `config` resumes from (None for a fresh run); refuses 'last' when there is none.
    Under 'last', newer checkpoints whose files are damaged are passed over and added to `skipped`.

    >>> from hp.train.config import validate
    >>> resume_path(validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "/nonexistent",
    ...                       "resume_from_checkpoint": "last"}))
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: resume_from_checkpoint = 'last': output_dir = '/nonexistent' holds no complete checkpoint; leave resume_from_checkpoint out to start a fresh run
    """
    from hp.train.checkpoint import latest

    resume = config.resume_from_checkpoint
    if resume != RESUME_LAST:
        return resume
    passed: list[tuple[str, str]] = []
    found = latest(config.output_dir, passed)
    if skipped is not None:
        skipped += passed
    if found is None:
        damaged = f" ({len(passed)} damaged: {passed[0][1]})" if passed else ""
        raise ConfigError(f"resume_from_checkpoint = {RESUME_LAST!r}: output_dir = {config.output_dir!r} holds no "
                          f"complete checkpoint{damaged}; leave resume_from_checkpoint out to start a fresh run")
    return found


def _trainer_state(config: TrainConfig) -> dict[str, Any] | None:
    """The trainer state of the checkpoint to resume from, read safely; None for a fresh run."""
    from hp.train.checkpoint import CheckpointError, trainer_state

    skipped: list[tuple[str, str]] = []
    path = resume_path(config, skipped)
    for damaged, why in skipped:
        print(f"hp train: note: resume_from_checkpoint = 'last' passes over {damaged}: {why}", file=sys.stderr)
    if path is None:
        return None
    try:
        return trainer_state(path)
    except CheckpointError as e:
        raise ConfigError(f"resume_from_checkpoint = {config.resume_from_checkpoint!r}: {e}") from None


def _check_model(config: TrainConfig, vocab_size: int) -> None:
    """The model's config and weights, and the strategy against them (expert parallel needs experts, ...)."""
    from hp.train.data.embedded import EMBEDDED, model_config
    from hp.train.config.validation import check_tp2d_rows
    from hp.train.model import check_fits, resolved_strategy

    try:
        hf_config = model_config(config.model_name_or_path, vocab_size)
    except (OSError, ValueError) as e:
        raise ConfigError(_model_words(config, e)) from None
    weights = None if config.model_name_or_path in EMBEDDED else config.model_name_or_path
    strategy = resolved_strategy(config, hf_config)
    if strategy != config.parallel:
        t2 = strategy.tp2d
        chosen = f"{t2.scheme} on {', '.join(f'{a}={n}' for a, n in t2.mesh_axes.items())}" if t2 else \
            f"1D tensor parallel, tp = {strategy.tp}"
        print(f"hp train: note: parallel.tp2d: auto chose {chosen}, the fewest bytes for this model's shapes "
              f"(hp.tp_plan.choose)", file=sys.stderr)
    check_tp2d_rows(config, strategy)
    check_fits(hf_config, strategy, weights=weights, name=config.model_name_or_path,
               labels=strategy_labels(config),
               expert_module_cls=(config.hyper_parallel_args or {}).get("expert_module_cls"),
               finetuning=config.finetuning)
    if config.ref_model is not None:
        _check_reference(config, hf_config, vocab_size)


def _check_reference(config: TrainConfig, policy, vocab_size: int) -> None:
    """A preference stage's `ref_model`: a model of the policy's vocabulary that the strategy lays out."""
    from hp.train.data.embedded import EMBEDDED, model_config
    from hp.train.model import check_fits

    try:
        reference = model_config(config.ref_model, vocab_size)
        check_fits(reference, config.parallel, weights=None if config.ref_model in EMBEDDED else config.ref_model,
                   name=config.ref_model, labels=strategy_labels(config))
    except (OSError, ValueError) as e:
        raise ConfigError(f"ref_model = {config.ref_model!r}: {e}") from None
    if reference.get_text_config().vocab_size != policy.get_text_config().vocab_size:
        raise ConfigError(f"ref_model = {config.ref_model!r} has a vocabulary of {reference.get_text_config().vocab_size}"
                          f" tokens and model_name_or_path {policy.get_text_config().vocab_size}: the reference must "
                          "score the policy's tokens; expected a model of the same tokenizer")


def _model_words(config: TrainConfig, error: Exception) -> str:
    text = str(error)
    key = "model_name_or_path"
    return text if text.startswith(key) else f"{key} = {config.model_name_or_path!r}: {text}"


def _check_template(config: TrainConfig, tokenizer) -> None:
    """The template can encode with this tokenizer: each special token it spells is one token, or, unset,
    the tokenizer's chat_template reads as a template."""
    from hp.train.data.encoding import template_for

    try:
        template_for(config.template, tokenizer, config.stage)
    except ValueError as e:
        raise ConfigError(str(e)) from None  # the message names the template (or says it is unset) and the tokens


def _check_data(config: TrainConfig, tokenizer, state: dict[str, Any] | None) -> tuple:
    """Every dataset parses into examples, enough to fill a global batch, at the resumed position if any."""
    from hp.train.data import TokenBatches, load_splits

    try:
        splits = load_splits(config, tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    examples = splits[0]
    rows = config.per_device_train_batch_size * config.parallel.dp
    try:
        batches = TokenBatches(examples, rows, config.seed, tokenizer.pad_token_id)
    except ValueError as e:
        raise ConfigError(f"per_device_train_batch_size = {config.per_device_train_batch_size} "
                          f"(x dp = {config.parallel.dp}): {e}") from None
    if state is not None:
        try:
            batches.load_state_dict(state["data"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"resume_from_checkpoint = {config.resume_from_checkpoint!r}: {e}") from None
    return splits
