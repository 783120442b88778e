"""`hp.Strategy`: how a model is parallelized, as one typed value checked once.

A strategy names the degrees of each kind of parallelism (data, context,
tensor, expert), the algorithms and switches that go with them (sequence
parallel, ring or Ulysses attention, FSDP over the data and context axes with
its mixed precision and resharding, expert load balancing, offload,
recompute, `hp.mpmd`'s chunks or placement) and nothing about any model.

Expert parallel splits the data-parallel ranks, as in torchtitan: ep divides
dp, and the mesh's data axis becomes two, `dp` (dp / ep groups, each holding
every expert once) and `ep` (the ranks of a group, holding E / ep experts
each). The batch is split over both (`b/dp/ep`), every parameter but the
experts' is replicated over both, and the experts' are split over ep and
replicated over dp (and cp), so FSDP shards them over those ranks only. The
trainer, the launcher and every model plan take the same value: it is built
and validated here, in plain Python (no torch), so that `hp train` can
refuse a bad strategy before any worker starts. What a strategy means for a
model's shapes (a tp that does not divide the heads, say) is checked by
`Strategy.check_fits`, given the model's config, also before then.

Every refusal is a `StrategyError` whose `key` names the field (a caller that read
it elsewhere, a YAML section or HyperParallel's JSON, can say where)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hp.parallel.field_error import FieldError
from hp.parallel.placement import Placement, check_zero_bubble
from hp.parallel.tp2d import TP2D

CP_ALGORITHMS = ("ulysses", "ring")  # how attention runs on a sequence split over cp (hp.ops.context_parallel)
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # mesh order: stages outermost, tensor innermost (neighbouring ranks)
# torch.distributed.pipelining's schedules, by the names its get_schedule_class takes: one stage per rank,
# several in a loop, or two in a V (the first and the last stage on rank 0)
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # backward split: input, then weight gradients
PP_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": None, "LoopedBFS": None, "InterleavedZeroBubble": None,
                "ZBVZeroBubble": 2, "DualPipeV": 2}
OFFLOAD_TIERS = ("host", "disk")
DEFAULT_OFFLOAD_BUDGET = 0.5
DTYPES = ("float32", "bfloat16", "float16")  # what FSDP may gather parameters and reduce gradients in
FSDP_OPTIONS = ("reshard_after_forward", "param_dtype", "reduce_dtype")  # FSDP2's own: refused without FSDP


class StrategyError(ValueError):
    """A strategy that cannot run: `key = value` of the field at fault, then `problem`.

    A caller that read the value under another name re-words the start and keeps `problem`.
    """

    def __init__(self, key: str, value: Any, problem: str) -> None:
        super().__init__(f"{key} = {value!r}{problem}")
        self.key, self.value, self.problem = key, value, problem


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Degrees and switches of a parallel layout; validated on construction.

    >>> import hp
    >>> s = hp.Strategy(dp=2, tp=2, sp=True)
    >>> s.world_size, s.mesh_axes, s.sequence_chunks
    (4, {'dp': 2, 'tp': 2}, 2)
    >>> hp.Strategy(dp=4, ep=2).mesh_axes
    {'dp': 2, 'ep': 2}
    >>> hp.Strategy(cp=2, cp_algorithm="flash")
    Traceback (most recent call last):
    ...
    hp.parallel.strategy.StrategyError: cp_algorithm = 'flash': expected one of 'ulysses', 'ring'
    >>> hp.Strategy(tp=2, recompute=True).recompute
    True
    >>> hp.Strategy(recompute="full")
    Traceback (most recent call last):
    ...
    hp.parallel.strategy.StrategyError: recompute = 'full': expected true or false
    """

    dp: int = 1  # data parallel: the batch is split over dp ranks
    cp: int = 1  # context parallel: the sequence is split over cp ranks
    tp: int = 1  # tensor parallel (Megatron) degree
    sp: bool = False  # sequence parallel over tp: the residual stream is split by tokens
    cp_algorithm: str = "ulysses"  # one of CP_ALGORITHMS
    fsdp: bool = False  # FSDP2 shards parameters over dp x cp instead of replicating them
    reshard_after_forward: bool = True  # FSDP frees a block's gathered parameters after forward (false: kept)
    param_dtype: str | None = None  # FSDP gathers and computes parameters in this dtype (None: their own)
    reduce_dtype: str | None = None  # FSDP reduces gradients in this dtype (None: the gradients' own)
    ep: int = 1  # expert parallel: the experts are split over ep of the dp ranks (ep divides dp)
    expert_bias_rate: float = 0.0  # aux-loss-free balancing: routing bias step toward the mean load (0: off)
    tp2d: TP2D | None = None  # 2D tensor parallel over mesh axes x, y (z), replacing tp (hp.parallel.tp2d)
    offload: str | None = None  # hp.offload's slow tier for saved activations (None: nothing offloaded)
    offload_budget: float = DEFAULT_OFFLOAD_BUDGET  # hp.offload's budget: this fraction of the step's recorded peak
    vision_tp: bool = False  # a vision-language model's vision tower splits over tp too (else replicated)
    recompute: bool = False  # each decoder block recomputes its activations in backward instead of keeping them
    compile: bool = False  # each decoder block and the loss under torch.compile(fullgraph=True) (hp.parallel.compiled)
    mpmd: int | str | None = None  # hp.mpmd's chunks: a count, "auto" (planned), or None (the step as it is)
    mpmd_place: Placement | None = None  # hp.mpmd's sub-models on ranks of their own (hp.parallel.placement)
    mpmd_zero_bubble: bool = False  # a placed step's pipeline splits its backward (input and weight gradients)
    pp: int = 1  # pipeline parallel: the blocks cut into stages over pp ranks (hp.parallel.pipeline)
    pp_schedule: str = "1F1B"  # one of PP_SCHEDULES
    pp_microbatches: int | None = None  # micro-batches a step's batch is cut into (None: one per stage)
    pp_stages_per_rank: int | None = None  # stages each pp rank runs (None: what the schedule takes, 1 or 2)
    pp_split: tuple[int, ...] | None = None  # blocks per stage, overriding the cost-balanced split

    def __post_init__(self) -> None:
        for key in ("dp", "cp", "tp", "ep", "pp"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(key, value, ": expected an integer >= 1")
        for key in ("sp", "fsdp", "reshard_after_forward", "recompute", "vision_tp", "compile"):
            if not isinstance(getattr(self, key), bool):
                raise StrategyError(key, getattr(self, key), ": expected true or false")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) is not None and getattr(self, key) not in DTYPES:
                raise StrategyError(key, getattr(self, key), f": expected {_one_of(DTYPES)} or null")
        if not isinstance(self.expert_bias_rate, (int, float)) or isinstance(self.expert_bias_rate, bool) \
                or not 0 <= self.expert_bias_rate < float("inf"):
            raise StrategyError("expert_bias_rate", self.expert_bias_rate, ": expected a number >= 0 (0: off)")
        if self.dp % self.ep:
            raise StrategyError("ep", self.ep, f" does not divide dp = {self.dp}: expert parallel splits the "
                                "data-parallel ranks (each group of ep ranks holds every expert once); raise dp "
                                "(the world is dp x cp x tp) or lower ep")
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise StrategyError("cp_algorithm", self.cp_algorithm, f": expected {_one_of(CP_ALGORITHMS)}")
        if self.mpmd is not None and not is_chunks(self.mpmd):
            raise StrategyError("mpmd", self.mpmd, ": expected a number of chunks >= 1, 'auto', or null")
        if self.offload is not None and self.offload not in OFFLOAD_TIERS:
            raise StrategyError("offload", self.offload, f": expected {_one_of(OFFLOAD_TIERS)} or null")
        if not isinstance(self.offload_budget, (int, float)) or isinstance(self.offload_budget, bool) \
                or not 0 < self.offload_budget <= 1:
            raise StrategyError("offload_budget", self.offload_budget, ": expected a fraction of the step's recorded "
                                "peak memory, in (0, 1]")
        if self.offload is None and self.offload_budget != DEFAULT_OFFLOAD_BUDGET:
            raise StrategyError("offload_budget", self.offload_budget, ": only offload has a budget; set offload "
                                "(disk), or leave it out")
        if self.offload is not None and self.recompute:
            raise StrategyError("offload", self.offload, ": offload and recompute both cut saved activations; "
                                "choose one")
        self._refuse_fsdp_options_without_fsdp()
        self._refuse_what_is_not_built()
        self._check_tp2d()
        self._check_pipeline()
        self._check_placement()

    def _typed(self, field: str, of: Callable[[Any], Any], prefix: str) -> None:
        """Field `field` made its typed value by `of`; a bad one named under `prefix` (`tp2d.x`)."""
        try:
            object.__setattr__(self, field, of(getattr(self, field)))
        except FieldError as e:
            raise StrategyError(f"{prefix}{e.key}".rstrip("."), e.value, e.problem) from None  # key "": the whole

    def _check_placement(self) -> None:
        try:
            check_zero_bubble(self.mpmd_place, self.mpmd_zero_bubble)
            if self.mpmd_place is None:
                return
            self._typed("mpmd_place", Placement.of, "mpmd.place.")
            for key in PLACED_ALONE:
                if getattr(self, key) != DEFAULTS[key]:
                    why = ("the placed step orders its work from measured costs, not by a pipeline schedule"
                           if key.startswith("pp_") else "a placed program's stages are laid out over tp alone "
                           "(other axes inside them are not built yet)")
                    raise StrategyError(key, getattr(self, key), f" with mpmd.place: {why}; leave it out")
            self.mpmd_place.check_pipeline(self.pp, self.pp_split)
        except FieldError as e:
            raise StrategyError(e.key, e.value, e.problem) from None

    def _check_tp2d(self) -> None:
        if self.tp2d is None:
            return
        self._typed("tp2d", TP2D.of, "tp2d.")
        for key, problem in (("tp", "2D tensor parallel replaces 1D: its ranks are x * y (* z); set tp to 1"),
                             ("sp", "the 2D layouts already split the residual stream's tokens; leave sp out"),
                             ("ep", "2D tensor parallel runs the dense families; leave ep out"),
                             ("vision_tp", "2D tensor parallel runs the dense families; leave vision_tp out"),
                             ("mpmd", "hp.mpmd pipelines 1D tensor parallel's collectives; leave it out with tp2d")):
            if getattr(self, key) != DEFAULTS[key]:
                raise StrategyError(key, getattr(self, key), f" with tp2d: {problem}")

    def _check_pipeline(self) -> None:
        if self.pp_schedule not in PP_SCHEDULES:
            raise StrategyError("pp_schedule", self.pp_schedule, f": expected {_one_of(tuple(PP_SCHEDULES))}")
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise StrategyError(key, value, ": expected an integer >= 1, or null")
        takes = PP_SCHEDULES[self.pp_schedule]
        if takes is not None and self.pp_stages_per_rank not in (None, takes):
            raise StrategyError("pp_stages_per_rank", self.pp_stages_per_rank, f": the {self.pp_schedule} schedule "
                                f"runs {takes} stage{'s' if takes > 1 else ''} per rank")
        if self.pp > 1:
            for key in ("offload", "mpmd"):
                if getattr(self, key) is not None:
                    raise StrategyError(key, getattr(self, key), " with pp: not available yet (the pipeline's "
                                        "schedule runs the step); leave it out with pp")
        if self.pp > 1 and self.fsdp and self.pp_schedule in ZERO_BUBBLE:
            raise StrategyError("pp_schedule", self.pp_schedule, ": a zero-bubble schedule computes weight gradients "
                                "apart from input gradients, which FSDP's gathered parameters do not allow; use "
                                "1F1B or Interleaved1F1B with fsdp")
        if self.pp_microbatches is not None and self.pp_microbatches < self.pp:
            raise StrategyError("pp_microbatches", self.pp_microbatches, f": fewer micro-batches than pp = {self.pp} "
                                "stages leaves stages idle all step; expected at least pp")
        if self.pp_split is not None:
            split = tuple(self.pp_split)
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in split):
                raise StrategyError("pp_split", self.pp_split, ": expected a count of blocks per stage, each >= 1")
            if len(split) != self.pp_stages:
                raise StrategyError("pp_split", self.pp_split, f": {len(split)} stages given, but pp = {self.pp} x "
                                    f"{self.stages_per_rank} per rank makes {self.pp_stages}")
            object.__setattr__(self, "pp_split", split)
        if self.pp == 1 and any(getattr(self, k) != DEFAULTS[k] for k in PP_OPTIONS):
            key = next(k for k in PP_OPTIONS if getattr(self, k) != DEFAULTS[k])
            raise StrategyError(key, getattr(self, key), ": only pipeline parallel has this option; set pp > 1, "
                                "or leave it out")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank runs: as asked, else what the schedule takes (1; 2 for the looped
        and V schedules)."""
        takes = PP_SCHEDULES[self.pp_schedule]
        return self.pp_stages_per_rank or takes or 2

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp x stages per rank (1 without pp).

        >>> Strategy(pp=2, pp_schedule="ZBVZeroBubble").pp_stages, Strategy().pp_stages
        (4, 1)
        """
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: as asked, else one per stage."""
        return self.pp_microbatches or self.pp_stages

    @property
    def within_stage(self) -> Strategy:
        """The strategy each pipeline stage is laid out by: this one without pp.

        >>> Strategy(pp=2, tp=2, pp_schedule="GPipe").within_stage == Strategy(tp=2)
        True
        """
        return dataclasses.replace(self, pp=1, **{k: DEFAULTS[k] for k in PP_OPTIONS})

    def _refuse_fsdp_options_without_fsdp(self) -> None:
        """FSDP's own options given where FSDP does not run would silently change nothing."""
        given = {key: getattr(self, key) for key in FSDP_OPTIONS if getattr(self, key) != DEFAULTS[key]}
        for key, value in given.items():
            if not self.fsdp:
                raise StrategyError(key, value, ": only FSDP has this option; set fsdp true, or leave it out")
            if not self.fsdp_axes:
                raise StrategyError(key, value, ": FSDP has no ranks to shard over (dp x cp = 1), so it does not "
                                    "run; raise dp or cp, or leave it out")

    def _refuse_what_is_not_built(self) -> None:
        if self.offload == "host":
            raise StrategyError("offload", "host", ": the host tier (pinned memory and a copy stream on an "
                                "accelerator) is not available yet; use offload: disk")

    @classmethod
    def of(cls, spec: Strategy | Mapping[str, Any] | None) -> Strategy:
        """A Strategy from itself, a mapping of its fields, or None (one device).

        >>> Strategy.of({"tp": 2, "sp": True}) == Strategy(tp=2, sp=True)
        True
        >>> Strategy.of({"zp": 2})
        Traceback (most recent call last):
        ...
        hp.parallel.strategy.StrategyError: zp = 2: unknown strategy key; expected one of dp, cp, tp, sp, cp_algorithm, fsdp, reshard_after_forward, param_dtype, reduce_dtype, ep, expert_bias_rate, tp2d, offload, offload_budget, vision_tp, recompute, compile, mpmd, mpmd_place, mpmd_zero_bubble, pp, pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split
        """
        if spec is None:
            return cls()
        if isinstance(spec, Strategy):
            return spec
        for key, value in spec.items():
            if key not in FIELDS:
                raise StrategyError(str(key), value, f": unknown strategy key; expected one of {', '.join(FIELDS)}")
        return cls(**spec)

    def as_dict(self) -> dict[str, Any]:
        """The fields, in order (what `Strategy.of` takes back; the placement as written, `{vision: pp}`)."""
        fields = dataclasses.asdict(self)
        return fields | {"mpmd_place": self.mpmd_place.as_dict() if self.mpmd_place is not None else None}

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: pp * dp * cp * tp (x * y * z for tp2d); placed, (pp + its own ranks) * dp * tp."""
        if self.mpmd_place is not None:  # dp replicas of the placed step, each of tp planes
            return (self.pp + self.mpmd_place.own_ranks) * self.dp * self.tp
        return self.pp * self.dp * self.cp * self.tp * (self.tp2d.ranks if self.tp2d else 1)

    @property
    def mesh_axes(self) -> dict[str, int]:
        """The mesh's axes: those of size > 1, in mesh order (`{"tp": 1}` for one device).

        Only axes that split something exist: DTensor's redistribution planner
        slows down sharply with idle size-1 axes.
        """
        if self.mpmd_place is not None:  # the placed programs' ranks, each stage laid out over tp of them
            return {PLACED_AXIS: self.world_size // self.tp, **({"tp": self.tp} if self.tp > 1 else {})}
        degrees = {"dp": self.dp // self.ep, "ep": self.ep, "cp": self.cp,
                   **(self.tp2d.mesh_axes if self.tp2d else {"tp": self.tp})}
        within = {name: n for name, n in degrees.items() if n > 1} or {"tp": 1}
        return {"pp": self.pp, **within} if self.pp > 1 else within

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: dp and ep of size > 1 (the batch layout is `b/dp/ep`)."""
        return tuple(axis for axis in ("dp", "ep") if axis in self.mesh_axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch of tokens is split over: the batch axes, then cp.

        >>> Strategy(dp=4, ep=2, cp=2, tp=2).token_axes
        ('dp', 'ep', 'cp')
        """
        return (*self.batch_axes, *(("cp",) if self.cp > 1 else ()))

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The mesh axes FSDP shards parameters over, flattened: dp and cp of size > 1 (none without fsdp).

        Every rank of a cp group holds a different shard (torchtitan's `dp_shard_cp`): the cp
        ranks hold the same parameters anyway, and FSDP's reduce-scatter over dp x cp does the
        sum over cp that the gradients need, as the one over dp.

        >>> Strategy(dp=2, cp=2, tp=2, fsdp=True).fsdp_axes, Strategy(cp=2, fsdp=True).fsdp_axes
        (('dp', 'cp'), ('cp',))
        >>> Strategy(dp=4, ep=2, fsdp=True).fsdp_axes
        ('dp', 'ep')
        """
        return tuple(axis for axis in ("dp", "ep", "cp") if self.fsdp and axis in self.mesh_axes)

    @property
    def expert_fsdp_axes(self) -> tuple[str, ...]:
        """The mesh axes FSDP shards the experts over: those of `fsdp_axes` that hold the same experts (not ep).

        >>> Strategy(dp=4, ep=2, fsdp=True).expert_fsdp_axes, Strategy(dp=2, ep=2, fsdp=True).expert_fsdp_axes
        (('dp',), ())
        """
        return tuple(axis for axis in self.fsdp_axes if axis != "ep")

    @property
    def only_batch(self) -> bool:
        """Whether only the batch splits (dp, no tp, cp, ep or FSDP): what plain data parallel runs."""
        return self.tp == self.cp == self.ep == 1 and not self.fsdp and self.tp2d is None

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is split by tokens over tp."""
        return self.sp and self.tp > 1

    @property
    def ring(self) -> bool:
        """Whether attention runs as ring attention (in head-tail order)."""
        return self.cp > 1 and self.cp_algorithm == "ring"

    @property
    def sequence_chunks(self) -> int:
        """What the sequence length must be a multiple of: cp (2 cp for ring), times tp with sp."""
        return self.cp * (2 if self.ring else 1) * (self.tp if self.sequence_parallel else 1)

    @property
    def splits_sequence(self) -> bool:
        """Whether sequences are prepared before the model (label shift, padding, order)."""
        return self.cp > 1 or self.sequence_parallel

    def check_fits(self, config: Any) -> None:
        """Refuse a strategy that the model's shapes (an HF config) cannot take, naming both.

        >>> from transformers import LlamaConfig
        >>> Strategy(tp=3).check_fits(LlamaConfig(num_attention_heads=4, num_key_value_heads=2))
        Traceback (most recent call last):
        ...
        hp.parallel.strategy.StrategyError: tp = 3 does not divide num_attention_heads = 4 of the model
        """
        if self.pp > 1 and self.mpmd_place is None and getattr(config, "vision_config", None) is not None:
            raise StrategyError("pp", self.pp, f": {getattr(config, 'model_type', '?')} is a vision-language model, "
                                "whose vision tower the pipeline places with mpmd: {place: {vision: pp}} (in its "
                                "bubbles) or {place: {vision: N}} (on N ranks of its own); or use tp, dp or FSDP")
        if self.mpmd_place is not None:
            try:
                self.mpmd_place.check_fits(config)
            except FieldError as e:
                raise StrategyError(e.key, e.value, e.problem) from None
        config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VL model's decoder
        self._check_experts(config)
        self._check_stages(config)
        sizes = _split_sizes(config)
        if self.tp2d is not None:  # heads split over y, each whole on its rank
            for name in ("num_attention_heads", "num_key_value_heads"):
                if sizes[name] % self.tp2d.y:
                    raise StrategyError("tp2d.y", self.tp2d.y, f" does not divide {name} = {sizes[name]} of the model")
        for name, size in sizes.items():
            if size % self.tp:
                raise StrategyError("tp", self.tp, f" does not divide {name} = {size} of the model")
        if self.cp > 1 and self.cp_algorithm == "ulysses":
            for name in ("num_attention_heads", "num_key_value_heads"):
                if (sizes[name] // self.tp) % self.cp:
                    raise StrategyError("cp", self.cp, f" (Ulysses) does not divide the {sizes[name] // self.tp} heads "
                                        f"per tp rank ({name}); use cp_algorithm: ring")
        if self.ring and getattr(config, "attn_logit_softcapping", None):
            raise StrategyError("cp_algorithm", "ring", f" cannot soft-cap attention logits (attn_logit_softcapping = "
                                f"{config.attn_logit_softcapping}): ring attention merges blocks of SDPA; use ulysses")


    def resolved(self, config: Any, tokens: int) -> Strategy:
        """This strategy with `tp2d.scheme: auto` decided for an HF config and the `tokens` of a step per
        data-parallel group (`hp.parallel.tp2d.TP2D.resolved`): the cheapest 2D scheme, or 1D tp.

        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=512, num_attention_heads=8, intermediate_size=1024)
        >>> Strategy(tp2d={"x": 2, "y": 2, "scheme": "auto"}).resolved(config, tokens=4096).tp2d
        TP2D(x=2, y=2, z=1, scheme='summa')
        >>> Strategy(tp2d={"x": 2, "y": 2, "scheme": "auto"}).resolved(config, tokens=256).tp
        4
        """
        if self.tp2d is None or self.tp2d.scheme != "auto":
            return self
        chosen = self.tp2d.resolved(config.get_text_config() if hasattr(config, "get_text_config") else config, tokens)
        if chosen is None:
            return dataclasses.replace(self, tp2d=None, tp=self.tp2d.ranks)
        return dataclasses.replace(self, tp2d=chosen)

    def _check_stages(self, config: Any) -> None:
        if self.pp == 1:
            return
        layers = config.num_hidden_layers
        if self.pp_stages > layers:
            raise StrategyError("pp", self.pp, f" x {self.stages_per_rank} stages per rank makes {self.pp_stages} "
                                f"stages for num_hidden_layers = {layers}: each stage needs a block; lower pp")
        if self.pp_split is not None and sum(self.pp_split) != layers:
            raise StrategyError("pp_split", self.pp_split, f": {sum(self.pp_split)} blocks given, the model has "
                                f"num_hidden_layers = {layers}")
        if getattr(config, "output_router_logits", False):
            raise StrategyError("pp", self.pp, ": the model adds a router auxiliary loss (output_router_logits), "
                                "which pipeline stages do not carry to the loss yet; turn it off, or leave pp out")

    def _check_experts(self, config: Any) -> None:
        experts = num_experts(config)
        if self.ep > 1 and not experts:
            raise StrategyError("ep", self.ep, f": the model ({getattr(config, 'model_type', '?')}) has no experts; "
                                "expert parallel needs an MoE model; set ep to 1")
        if self.ep > 1 and experts % self.ep:
            raise StrategyError("ep", self.ep, f" does not divide num_experts = {experts} of the model")
        if self.expert_bias_rate and not experts:
            raise StrategyError("expert_bias_rate", self.expert_bias_rate, ": the model has no experts to balance")


def num_experts(config: Any) -> int:
    """The routed experts of an HF config (0 for a dense model).

    >>> from transformers import AutoConfig
    >>> num_experts(AutoConfig.for_model("qwen3_moe", num_experts=8)), num_experts(AutoConfig.for_model("llama"))
    (8, 0)
    """
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return 0


FIELDS = tuple(f.name for f in dataclasses.fields(Strategy))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Strategy)}
PP_OPTIONS = ("pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_split")  # pipeline's own: refused without it
PLACED_AXIS = "mpmd"  # the mesh of a placed step: its graph's ranks (by tp planes), its programs' own
# What a placed step refuses: its stages are laid out over tp alone and it plans its own order (no pp schedule).
PLACED_ALONE = ("cp", "ep", "fsdp", "tp2d", "offload", "compile", "vision_tp", "mpmd",
                "pp_schedule", "pp_microbatches", "pp_stages_per_rank")


def _split_sizes(config: Any) -> dict[str, int]:
    """The sizes tensor parallelism splits: heads, key/value heads, MLP width."""
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }
    if getattr(config, "shared_expert_intermediate_size", None):  # a shared expert splits like a dense MLP
        sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return sizes


def _one_of(choices: tuple[str, ...]) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


def is_chunks(value: object) -> bool:
    """Whether `value` is what `hp.mpmd` pipelines over: a number of chunks >= 1, or "auto".

    >>> is_chunks(2), is_chunks("auto"), is_chunks(0), is_chunks(True)
    (True, True, False, False)
    """
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
