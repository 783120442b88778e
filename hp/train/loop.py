"""The training loop one worker runs: model, data, AdamW, schedule, logging, checkpoints.

Every rank draws the same global batches (`per_device_train_batch_size` x dp
rows per micro-batch) and the strategy lays them out, so data, cp and tp
ranks agree without a sampler. A batch (`hp.train.data.batch.Batch`) is passed
to the model as keywords: `input_ids` and `labels`, and for a
vision-language model its images (`mm_token_type_ids`, `pixel_values`,
`image_grid_thw`; HF computes the M-RoPE positions from them). One
optimizer step takes `gradient_accumulation_steps` micro-batches, each loss divided by their
number (HF Trainer's convention). Rank 0 shows a progress bar (loss,
tokens/s, memory), appends a JSON line per logging step to
`output_dir/metrics.jsonl`, draws `training_loss.png` when matplotlib is
installed, and prints a summary JSON object as its last stdout line:
first/last loss, steps, tokens/s, collective bytes per step per mesh axis
(the first step traced with `hp.comm.trace()`, eagerly: compiled blocks
compile on the second), peak memory, and the latest
evaluation loss and perplexity. A mixture-of-experts model's load balance is
measured after every optimizer step (`hp.parallel.expert_balance.measure`, on every
rank: the tokens each expert got, summed over ranks): rank 0 shows the
imbalance (most loaded expert over the mean) in the progress bar and writes
it, with the tokens per expert of each MoE layer, into that step's metrics
line; with the strategy's `expert_bias_rate`, every rank then moves its
routing bias toward balance (`nudge_routing_bias`). Evaluation (HF Trainer's `eval_strategy`,
`eval_steps`, `do_eval`) runs the held-out examples through the laid-out
model without gradients; its loss is the mean over supervised tokens, as if
all examples were one batch (its expert loads are dropped: they are not the
next step's). Metrics and summary are strict JSON: a loss or gradient norm
that stops being finite ends the run with `TrainingError` naming the step,
before that step's update is saved, so the last checkpoint stays the last
good one. Checkpoints are written in the background (`async_save`) and
published at the next save or the end. A resumed run first drops the
metrics lines past its checkpoint (they would repeat).

The stage decides what a micro-batch's loss is (`hp.train.objectives`): the
model's own loss for pt and sft; for dpo and kto the preference loss
against a reference model, built like the policy from `ref_model` (default
`model_name_or_path`) and frozen, or, under LoRA without `ref_model`, the
policy with its adapters off; for rm a value head's pairwise loss. The
preference stages' rewards, margins and accuracies (LlamaFactory's
`rewards/...` names) are averaged as LlamaFactory averages them: over the
micro-batches of a step, and over the steps since the last metrics line.
The progress bar shows each step's; each metrics line, the mean since the
one before; the summary, the mean over the run's last logging window
(`rewards`) and the first step's (`first_rewards`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import hp
from hp.device import bind_local_device, detect
from hp.parallel.expert_balance import ExpertLoad, measure, nudge_routing_bias
from hp.parallel.pipeline import Pipeline, pipeline_of
from hp.parallel.plain_dp import accumulating
from hp.mpmd.placed import Placed
from hp.mpmd.transform import Mpmd
from hp.models import plan_for
from hp.plot import pyplot
from hp.train import checkpoint, restarts
from hp.train.config import PREFERENCE_STAGES, TrainConfig, to_dict
from hp.train.data import IGNORE_INDEX, TokenBatches, eval_batches, load_splits, load_tokenizer
from hp.train.data.embedded import model_config
from hp.train.clipping import clip_counted, clip_gradients, scalar
from hp.train.errors import TrainingError
from hp.train.loader import loader
from hp.train.finetuning import Finetuning
from hp.train.model import build_model, freeze_parts, resolved_strategy
from hp.train.pipelined import LENGTH_STEP, pipelined_step
from hp.train.placed import PlacedRun, place, placed_evaluation, placed_step, placed_summary
from hp.train.precision import autocast
from hp.train.objectives import Dpo, Kto, LanguageModeling, Reference, Reward
from hp.train.preflight import resume_path
from hp.train.report import METRICS, TENSORBOARD_DIR, Reporter


@dataclass
class Progress:
    """What rank 0 reports: losses per step, token counts, timing."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    comm: dict[str, int] = field(default_factory=dict)  # mesh axis -> bytes per rank per step
    eval_loss: float | None = None  # the latest evaluation's
    expert_load: ExpertLoad | None = None  # the latest step's, for a mixture-of-experts model
    offload_bytes: int | None = None  # bytes hp.offload wrote out and read back in the latest planned step
    rewards: list[dict[str, float]] = field(default_factory=list)  # a preference stage's, each step's since the
    logged_rewards: dict[str, float] = field(default_factory=dict)  # last metrics line, and that line's mean
    first_rewards: dict[str, float] = field(default_factory=dict)  # the first step's of this run
    mpmd: Mpmd | None = None  # the pipelined step, under parallel.mpmd: its plan and last report
    placed: PlacedRun | None = None  # the placed step, under parallel.mpmd.place: its plan and cost table
    started: float = field(default_factory=time.perf_counter)  # the loop's start, for each record's elapsed_s

    def rewards_window(self) -> dict[str, float]:
        """The mean of the steps' rewards since the last metrics line (that line's, when none came since)."""
        if not self.rewards:
            return self.logged_rewards
        return {key: sum(r[key] for r in self.rewards) / len(self.rewards) for key in self.rewards[-1]}


def train(config: TrainConfig) -> dict:
    """Run `config` on this worker (one of the launched ranks, or alone); returns rank 0's summary.

    >>> # see `hp train examples/quickstart.yaml`; tests/test_train.py runs short configs
    """
    _join_workers(config.ddp_timeout)
    tokenizer = load_tokenizer(config.model_name_or_path)
    strategy = resolved_strategy(config, model_config(config.model_name_or_path, tokenizer.vocab_size))
    config = replace(config, parallel=strategy)
    mesh = hp.strategy_mesh(strategy)
    examples, held_out = load_splits(config, tokenizer)
    dp = config.parallel.dp
    scheduled = strategy.pp > 1 and strategy.mpmd_place is None  # torch's pipeline schedules: few lengths
    batches = TokenBatches(examples, config.per_device_train_batch_size * dp, config.seed, tokenizer.pad_token_id,
                           vision=examples.vision, pad_to_multiple_of=LENGTH_STEP if scheduled else 1)
    evaluation = (eval_batches(held_out, config.per_device_eval_batch_size * dp, tokenizer.pad_token_id)
                  if config.evaluates else [])
    model = build_model(config.model_name_or_path, tokenizer.vocab_size, mesh, strategy, seed=config.seed,
                        finetuning=config.finetuning, value_head=config.stage == "rm")
    objective = make_objective(config, model, mesh, tokenizer.vocab_size)
    freeze_parts(model, vision_tower=config.freeze_vision_tower, projector=config.freeze_multi_modal_projector,
                 language_model=config.freeze_language_model)
    placed = (place(model, config, getattr(objective, "reference", None), batches, tokenizer.pad_token_id, mesh)
              if strategy.mpmd_place is not None else None)  # cut to this rank's programs
    progress = Progress(placed=placed)
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen weights keep no optimizer state
    optimizer = adamw(trained, lr=config.learning_rate, weight_decay=config.weight_decay)
    total = total_steps(config, len(batches))
    scheduler = _scheduler(config, optimizer, total)
    step = _restore(config, model, optimizer, scheduler, batches)
    stream = loader(batches, config.dataloader_num_workers)
    rank0 = checkpoint.rank() == 0
    if rank0:
        _prepare_output_dir(config, step)
    report = (Reporter(config.output_dir, config.report_to, resumed_at=step, logging_dir=config.logging_dir)
              if rank0 else None)
    bar = _progress_bar(total, step) if rank0 else None
    device, first = mesh.device_type, step
    forward_backward = functools.partial(_step, objective, stream, config, device)
    pipe = pipeline_of(model)
    if pipe is not None:  # the schedule runs forward and backward, micro-batch by micro-batch
        forward_backward = functools.partial(pipelined_step, pipe, stream, config.gradient_accumulation_steps,
                                             config.bf16, device)
    if placed is not None:  # each rank its own programs' actions, in the order planned from their costs
        forward_backward = functools.partial(placed_step, placed, stream, config, tokenizer.pad_token_id, device)
    if strategy.offload is not None:  # saved activations under a budget, AdamW's states away between updates
        blocks = tuple(model.get_submodule(plan_for(model.config).blocks))  # the planner may recompute these
        forward_backward = hp.offload(forward_backward, budget=strategy.offload_budget, modules=[model],
                                      optimizer=optimizer, recompute=blocks)
    offloaded = forward_backward
    if strategy.mpmd is not None:  # collectives in flight while other chunks compute
        forward_backward = progress.mpmd = hp.mpmd(forward_backward, chunks=strategy.mpmd)
    saver = checkpoint.Saver(config.output_dir, keep=config.save_total_limit, background=config.async_save)
    try:
        while step < total:
            epoch = batches.epoch
            start = time.perf_counter()
            with _traced() if step == first else nullcontext() as trace:  # every step moves the same bytes
                loss, tokens, rewards = forward_backward()
                hp.reduce_gradients(model)
                norm = _clip(model, placed.step if placed is not None else pipe, config.max_grad_norm)
                _require_finite(config, step + 1, loss, norm, saver)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            progress.expert_load = balance_experts(model, strategy.expert_bias_rate)
            last_run = getattr(offloaded, "last_run", None)
            if last_run is not None:
                progress.offload_bytes = last_run.bytes_moved
            progress.seconds += time.perf_counter() - start
            progress.tokens += tokens
            progress.losses.append(loss)
            if rewards:
                progress.rewards.append(rewards)
                progress.first_rewards = progress.first_rewards or rewards
            if trace is not None:
                progress.comm = {axis: sum(kinds.values()) for axis, kinds in trace.per_axis().items()}
            step += 1
            if rank0:
                _log(config, step, loss, scheduler.get_last_lr()[0], progress, bar, report, device)
            if _evaluates_now(config, step, batches.epoch > epoch, step == total):
                forward = placed_evaluation(placed, tokenizer.pad_token_id, device) if placed else None
                progress.eval_loss = evaluate(model, evaluation, config, device, forward)
                if rank0:
                    _log_eval(step, progress.eval_loss, bar, report)
            if config.save_steps > 0 and (step % config.save_steps == 0 or step == total):
                if strategy.offload is not None:
                    offloaded.restore_optimizer_states()  # the checkpoint holds their bytes
                extra = {"scheduler": scheduler.state_dict(), "data": batches.state_dict()}
                saver.save(step, model, optimizer, extra, tokenizer=tokenizer, model_only=config.save_only_model,
                           base_model=config.model_name_or_path)
        saver.close()  # the last checkpoint published before the summary
    finally:
        if bar is not None:
            bar.close()  # ends its line, also before a failure's message
        if report is not None:
            report.close()
    summary = _summary(config, progress, step, device)
    if rank0:
        _plot(config.output_dir)
        print(json.dumps(summary, allow_nan=False), flush=True)
    return summary


def _clip(model: nn.Module, spread: Placed | Pipeline | None, max_norm: float) -> float:
    """Clip the step's gradients to a global norm of `max_norm` (none: no limit); the norm before."""
    if spread is not None:  # some parameters held on several ranks: each counted once
        return clip_counted(spread, max_norm or math.inf)
    return clip_gradients(model.parameters(), max_norm or math.inf)


def make_objective(config: TrainConfig, model: nn.Module, mesh, vocab_size: int):
    """What the stage's micro-batch loss is (`hp.train.objectives`), with its reference model when it needs one."""
    strategy = config.parallel
    if config.stage not in PREFERENCE_STAGES:
        return LanguageModeling(model)
    if config.stage == "rm":
        return Reward(model, strategy)
    pref = config.preference
    reference = None
    if config.stage == "kto" or pref.uses_reference:
        reference = _reference(config, model, mesh, vocab_size)
    if config.stage == "kto":
        return Kto(model, reference, strategy, pref)
    return Dpo(model, reference, strategy, pref)


def _reference(config: TrainConfig, model: nn.Module, mesh, vocab_size: int) -> Reference:
    """The policy with its adapters off under LoRA (no ref_model), else a frozen model laid out like the policy."""
    if config.finetuning.lora is not None and config.ref_model is None:
        return Reference(model, adapters=True)
    frozen = build_model(config.ref_model or config.model_name_or_path, vocab_size, mesh, config.parallel,
                         seed=config.seed, finetuning=Finetuning())
    return Reference(frozen.requires_grad_(False).eval())


def adamw(params: list[torch.Tensor], *, lr: float = 1e-3, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """torch's AdamW over `params`, fused (one kernel over every tensor, as HF Trainer's `adamw_torch_fused`)
    where torch has the kernel for their device (`hp.offload` brings the states back to it before each step).
    No params (a rank running only a placed frozen program) is an optimizer that steps nothing."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = {p.device.type for p in params}
    fused = bool(params) and devices <= set(_get_fused_kernels_supported_devices()) \
        and all(p.is_floating_point() for p in params)
    return torch.optim.AdamW(params or [{"params": []}], lr=lr, weight_decay=weight_decay,
                             fused=fused or None)


def balance_experts(model: nn.Module, rate: float) -> ExpertLoad | None:
    """The expert load since the last call (None for a dense model), and the routing bias moved by `rate`.

    Every rank calls it at the same point (the load is summed over them), so every rank moves its
    bias the same way.
    """
    load = measure(model)
    if load is not None and rate:
        nudge_routing_bias(model, load, rate)
    return load


def _evaluates_now(config: TrainConfig, step: int, epoch_ended: bool, last: bool) -> bool:
    """HF Trainer's rule: every eval_steps (logging_steps when unset), or at each epoch's end; do_eval: at the end."""
    every = config.eval_strategy == "steps" and step % (config.eval_steps or config.logging_steps) == 0
    return every or (config.eval_strategy == "epoch" and epoch_ended) or (last and config.do_eval)


def evaluate(model: nn.Module, batches, config: TrainConfig, device: str, forward=None) -> float:
    """The mean loss per supervised token over `batches`, computed under the training strategy without gradients
    (`forward(batch)`: a placed step's loss, `hp.train.placed.placed_evaluation`)."""
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast(config.bf16, device):
        for batch in batches:
            supervised = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())  # HF shifts labels by one
            if supervised:
                pipe = pipeline_of(model)  # under pp the schedule runs the stages' forwards
                inputs = batch.inputs(device)
                loss = forward(batch) if forward else \
                    pipe.evaluate(inputs["input_ids"], inputs["labels"]) if pipe else model(**inputs).loss
                total += scalar(loss) * supervised
                tokens += supervised
    model.train()
    measure(model)  # every rank: the evaluation's expert loads are not the next training step's
    return total / tokens


def _log_eval(step: int, loss: float, bar, report: Reporter) -> None:
    bar.write(f"hp train: step {step}: eval_loss {loss:.4f}")
    report.write({"step": step, "eval_loss": loss, "eval_perplexity": _perplexity(loss)})


def _perplexity(loss: float | None) -> float | None:
    return math.exp(loss) if loss is not None and loss < 700 else None  # past that, exp overflows JSON's numbers


def _join_workers(timeout_s: int) -> None:
    """A launched worker joins the others' process group, whose collectives wait at most `timeout_s` (ddp_timeout)."""
    if "RANK" not in os.environ or dist.is_initialized():
        return  # a one-rank run: hp.strategy_mesh makes its own one-rank world
    device = detect()
    bind_local_device(device)
    dist.init_process_group(device.pg_backend, timeout=timedelta(seconds=timeout_s), **restarts.fresh_store())


def _require_finite(config: TrainConfig, step: int, loss: float, grad_norm: float, saver: checkpoint.Saver) -> None:
    """Stop before a non-finite loss or gradient reaches the weights (and a checkpoint), once the checkpoint
    being saved is published (every rank sees the same reduced loss and norm, so every rank stops here)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
    saver.finish()
    last = checkpoint.latest(config.output_dir)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved before it"
    raise TrainingError(f"step {step}: {what}, so training diverged and stopped; {kept}. Lower learning_rate "
                        f"(now {config.learning_rate:g}), raise warmup_ratio, or lower max_grad_norm")


def _restore(config: TrainConfig, model, optimizer, scheduler, batches: TokenBatches) -> int:
    """Load the checkpoint to resume from, if any; returns the step it reached (0 for a fresh run)."""
    resume = checkpoint.on_rank_zero(lambda: resume_path(config))
    if resume is None:
        return 0
    state = checkpoint.load(resume, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["data"])
    return state["step"]


def _prepare_output_dir(config: TrainConfig, step: int) -> None:
    """Rank 0: clear a run being overwritten; record the config."""
    if step == 0 and config.resume_from_checkpoint is None and config.overwrite_output_dir:
        _clear(config.output_dir)
    os.makedirs(config.output_dir, exist_ok=True)
    with open(os.path.join(config.output_dir, "hp_config.json"), "w") as f:
        json.dump(to_dict(config), f, indent=2)


def total_steps(config: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps when positive, else epochs of micro-batches / accumulation."""
    if config.max_steps > 0:
        return config.max_steps
    return max(1, math.ceil(config.num_train_epochs * batches_per_epoch / config.gradient_accumulation_steps))


@contextmanager
def _traced():
    """`hp.comm.trace()` over a step run eagerly: its dispatch mode sees every collective of hp's
    eager kernels, while compiled code cannot run under a dispatch mode (and issues the same ones)."""
    with torch.compiler.set_stance("force_eager"), hp.comm.trace() as trace:
        yield trace


def _step(objective, batches, config: TrainConfig, device: str) -> tuple[float, int, dict[str, float]]:
    """One optimizer step's forward and backward over the accumulated micro-batches; (loss, tokens, rewards)."""
    accumulate = config.gradient_accumulation_steps
    total, tokens, rewards = 0.0, 0, {}
    for micro in range(accumulate):
        batch = next(batches)
        with autocast(config.bf16, device):
            outcome = objective(batch, device)
        last = micro == accumulate - 1
        with nullcontext() if last else accumulating(objective.model):  # dp sums once, after the last
            (outcome.loss / accumulate).backward()
        total += scalar(outcome.loss) / accumulate
        for key, value in outcome.metrics.items():
            rewards[key] = rewards.get(key, 0.0) + value / accumulate
        tokens += sum(b.input_ids.numel() for b in (batch, batch.kl) if b is not None)  # processed, padding included
    return total, tokens, rewards


def _scheduler(config: TrainConfig, optimizer, total: int):
    from transformers import get_scheduler

    warmup = math.ceil(config.warmup_ratio * total)
    return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def _clear(output_dir: str) -> None:
    """Start over in `output_dir` (overwrite_output_dir): the old metrics, plot and checkpoints go."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if (name.startswith("checkpoint-") or name == TENSORBOARD_DIR) and os.path.isdir(path):
            shutil.rmtree(path)
        elif name in (METRICS, "training_loss.png", "hp_config.json"):
            os.remove(path)


def _progress_bar(total: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="hp train", dynamic_ncols=True)


def _log(config: TrainConfig, step: int, loss: float, lr: float, progress: Progress, bar, report: Reporter,
         device: str) -> None:
    tokens_per_s = progress.tokens / max(progress.seconds, 1e-9)
    memory = peak_memory_bytes(device)
    load = progress.expert_load
    moe = {} if load is None else {"moe": f"{load.imbalance:.2f}"}
    shown = {"acc": "rewards/accuracies", "margin": "rewards/margins", "kl": "kl"}
    latest = progress.rewards[-1] if progress.rewards else {}
    prefs = {name: f"{latest[key]:.3f}" for name, key in shown.items() if key in latest}
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", mem=f"{memory / 2**20:.0f}MiB", **moe, **prefs)
    bar.update(1)
    if step % config.logging_steps == 0 or step == 1:
        progress.logged_rewards, progress.rewards = progress.rewards_window(), []
        record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "peak_memory_bytes": memory,
                  "elapsed_s": round(time.perf_counter() - progress.started, 4), **progress.logged_rewards}
        if load is not None:
            record.update(expert_imbalance=load.imbalance, expert_load=[list(layer) for layer in load.per_layer])
        report.write(record)


def _summary(config: TrainConfig, progress: Progress, step: int, device: str) -> dict:
    moe = {} if progress.expert_load is None else {"expert_imbalance": progress.expert_load.imbalance}
    offload = {} if progress.offload_bytes is None else {"offload_bytes_per_step": progress.offload_bytes}
    mpmd = {} if progress.mpmd is None else {"mpmd": _mpmd_summary(progress.mpmd)}
    mpmd |= {} if progress.placed is None else {"mpmd_place": placed_summary(progress.placed)}
    rewards = {"rewards": w, "first_rewards": progress.first_rewards} if (w := progress.rewards_window()) else {}
    return {
        "first_loss": progress.losses[0] if progress.losses else None,
        "last_loss": progress.losses[-1] if progress.losses else None,
        "steps": step,
        "steps_this_run": len(progress.losses),
        "tokens_per_s": progress.tokens / max(progress.seconds, 1e-9),
        "comm_bytes_per_step": progress.comm,
        "eval_loss": progress.eval_loss,
        "eval_perplexity": _perplexity(progress.eval_loss),
        "peak_memory_bytes": peak_memory_bytes(device),
        **moe,  # a mixture-of-experts model's, at the last step
        **offload,  # under hp.offload: what its latest planned step moved
        **mpmd,  # under parallel.mpmd: the chunks, the last step's masking ratio, and why when not pipelined
        **rewards,  # a preference stage's (LlamaFactory's rewards/... names): the last window's and the first step's
        **restarts.so_far(),  # max_restarts: each restart's step, rank and cause
        "output_dir": config.output_dir,
    }


def _mpmd_summary(step) -> dict:
    """The chunks `hp.mpmd` planned and its last step's communication figures (this rank's)."""
    report, plan = step.report, step.plan
    return {"chunks": plan.chunks if plan else report.chunks, "masking": report.masking,
            "timeline_masking": report.timeline.masking,  # hp.mpmd.timeline: computed through / in flight
            "comm_seconds": report.comm_seconds, "exposed_seconds": report.exposed_seconds,
            **({"tried": {str(c): seconds for c, seconds in plan.tried}} if plan else {}),
            **({"reason": plan.reason} if plan and plan.reason else {})}


def peak_memory_bytes(device: str) -> int:
    """Peak memory of this rank: the accelerator's allocator peak, else the process's peak RSS."""
    if device != "cpu":
        return int(torch.get_device_module(device).max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _plot(output_dir: str) -> None:
    """training_loss.png from metrics.jsonl, when matplotlib (the `plot` extra) is installed."""
    plt = pyplot()
    path = os.path.join(output_dir, METRICS)
    if plt is None or not os.path.isfile(path):
        return
    with open(path) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]  # training steps, not evaluations
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("hp train")
    fig.savefig(os.path.join(output_dir, "training_loss.png"), dpi=100)
    plt.close(fig)
