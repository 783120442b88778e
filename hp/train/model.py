"""The model a training run starts from: an embedded tiny model, or a local HF directory, laid out.

The embedded models are built from a config in code (no download,
`hp.train.data.embedded`: `hp/tiny-llama`, `hp/tiny-qwen3-moe`,
`hp/tiny-qwen2.5-vl`), sized for the byte-level tokenizer and seeded. A
local directory (config.json and safetensors) of any family in the zoo
(`hp.models.supported()`, picked by the config's `model_type`) is built on
the meta device, laid out by the strategy with its family's plan, and then
each rank reads only its own blocks of the weights from the safetensors files
(`torch.distributed.checkpoint` with its HF reader), so a model larger than
one rank's memory still loads. A mixture of experts stored one expert at a
time, as transformers saves it, is read into the packed experts the model
holds, block by block (`hp.train.expert_weights`), and a family that
transformers saves under other names than its modules' (Qwen-VL's
`visual.*`, `model.layers.*`) is read by transformers' own renaming rules.

A reward model (stage rm) is the causal LM with a value head: a linear layer
`v_head` from the last hidden state to one score (TRL's and LlamaFactory's
value head, without dropout), whole on every rank and trained in full under
every finetuning type; it starts from `nn.Linear`'s draw under the run's
seed, and is saved with the model's weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hp.parallel.apply import apply_strategy, check_strategy
from hp.parallel.pipeline import pipeline
from hp.parallel.expert_balance import BIAS as ROUTING_BIAS
from hp.parallel.lora import LoraError, is_adapter, start_adapters
from hp.ops.local import copy_whole
from hp.parallel.parallelize import PlanError
from hp.parallel.plain_dp import USED_OUTSIDE_FORWARD
from hp.parallel.storable import from_storable, to_storable
from hp.parallel.strategy import Strategy, StrategyError, num_experts
from hp.parallel.ties import names_by_parameter, to_empty
from hp.train import expert_weights
from hp.train.config import ConfigError, TrainConfig
from hp.train.data.embedded import EMBEDDED, TINY_QWEN3_MOE, model_config
from hp.train.finetuning import Finetuning, FreezeError, apply_finetuning


class LoadError(RuntimeError):
    """A model whose weights, once loaded, are not all the checkpoint's (hp's fault, not the user's)."""


VALUE_HEAD = "v_head"  # the reward model's linear layer from the last hidden state to a score


def model_class(config):
    """The transformers auto class that builds a model of `config`: image-text-to-text for a vision-language one.

    >>> from hp.train.data.embedded import tiny_llama_config, tiny_qwen2_5_vl_config
    >>> model_class(tiny_llama_config(259)).__name__, model_class(tiny_qwen2_5_vl_config(265)).__name__
    ('AutoModelForCausalLM', 'AutoModelForImageTextToText')
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def check_fits(config, strategy: Strategy, *, weights: str | None = None, name: str | None = None,
               labels: Mapping[str, str] | None = None, expert_module_cls: str | None = None,
               finetuning: Finetuning = Finetuning()) -> None:
    """Refuse a model the zoo has no plan for, weights that do not fit it, or a strategy its shapes cannot take.

    A vision-language model must be one whose images hp train prepares (`hp.train.data.vision.Vision.of`).

    The model is built on the meta device (no memory, no weights); the
    safetensors in the directory `weights` (when given) must hold each of its
    parameters in its shape, and every layout the strategy would apply is
    bound to its parameter, as the workers would. Expert parallel and the
    routing bias need a mixture-of-experts model, and `expert_module_cls`
    (HyperParallel's) must name the class of the plan's MoE blocks or experts
    modules. `finetuning`'s adapters and frozen modules must name modules of
    the model, and the adapters' layouts fit as the base weights' do.
    `name` is the model as the config names it, and `labels` the key
    a strategy field was written as when not `parallel.FIELD` (say,
    HyperParallel's `hyper_parallel_args.ep_size`).

    >>> from hp.train.data.embedded import TINY_LLAMA, tiny_llama_config
    >>> check_fits(tiny_llama_config(259), Strategy(tp=3))
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: parallel.tp = 3 does not divide num_attention_heads = 4 of the model
    >>> check_fits(tiny_llama_config(259), Strategy(dp=2, ep=2), name=TINY_LLAMA)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: parallel.ep = 2: model_name_or_path = 'hp/tiny-llama' is a dense llama model, ...
    """
    from hp.models import plan_for
    from hp.train.data.vision import Vision

    labels = labels or {}
    try:
        plan = plan_for(config)
    except ValueError as e:
        raise ConfigError(f"model_name_or_path: {e}") from None
    try:
        Vision.of(config)  # a vision-language model whose images hp train prepares, or a text model
    except ValueError as e:
        raise ConfigError(f"model_name_or_path: {e}") from None
    _check_experts(config, strategy, name, labels)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    if weights is not None:
        check_weights(model, weights)
    try:
        apply_finetuning(model, finetuning, plan.blocks)
    except (LoraError, FreezeError) as e:
        kind = "lora" if finetuning.lora is not None else "freeze"
        raise ConfigError(f"finetuning_type = {kind!r}: {e}") from None
    try:
        check_strategy(model, strategy, plan)
    except StrategyError as e:
        raise ConfigError(f"{labels.get(e.key, f'parallel.{e.key}')} = {e.value!r}{e.problem}") from None
    except PlanError as e:
        raise ConfigError(f"parallel: the {config.model_type} plan does not fit this model under {_given(strategy)}: "
                          f"{e}") from None
    if expert_module_cls is not None:
        _check_expert_module_cls(model, plan, expert_module_cls)


def _check_experts(config, strategy: Strategy, name: str | None, labels: Mapping[str, str]) -> None:
    """Expert parallel or a routing bias asked of a dense model, in words that name the model."""
    from hp.models import MOE_FAMILIES

    if num_experts(config) or not (strategy.ep > 1 or strategy.expert_bias_rate):
        return
    model = f"model_name_or_path = {name!r}" if name else "the model"
    dense = f"{model} is a dense {config.model_type} model"
    if strategy.ep > 1:
        families = ", ".join(MOE_FAMILIES)
        raise ConfigError(f"{labels.get('ep', 'parallel.ep')} = {strategy.ep}: {dense}, with no experts to split; "
                          f"expert parallel needs a mixture-of-experts model ({families}; {TINY_QWEN3_MOE!r} is "
                          "embedded); set ep to 1")
    raise ConfigError(f"parallel.expert_bias_rate = {strategy.expert_bias_rate:g}: {dense}, with no experts whose "
                      "routing to balance; set it to 0, or leave it out")


def _check_expert_module_cls(model: nn.Module, plan, wanted: str) -> None:
    """HyperParallel's expert_module_cls is honoured when it names what hp's plan finds: the MoE blocks or experts."""
    names = [n for n, _ in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in plan.experts)]
    found = {type(model.get_submodule(n)).__name__ for n in names}
    found |= {type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in names}
    if wanted in found:
        return
    label = f"hyper_parallel_args.expert_module_cls = {wanted!r}"
    if not found:
        raise ConfigError(f"{label}: the model ({model.config.model_type}) has no experts; expected no "
                          "expert_module_cls")
    raise ConfigError(f"{label}: hp runs expert parallel on the experts its {model.config.model_type} plan names "
                      f"({' '.join(plan.experts)}), whose modules are {', '.join(sorted(found))}; expected one of "
                      "those, or no expert_module_cls")


def check_weights(model: nn.Module, directory: str) -> None:
    """Refuse a directory whose safetensors lack one of `model`'s weights or hold it in another shape.

    Only the files' headers are read.

    >>> check_weights(torch.nn.Linear(2, 2), "/nonexistent")
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: model_name_or_path = '/nonexistent' holds no *.safetensors weights
    """
    stored = _model_names(model, _stored_shapes(directory))
    parts = expert_weights.parts_of(model)
    for name, param in _loaded_state(model).items():
        try:
            if expert_weights.one_by_one(name, tuple(param.shape), stored, parts):
                continue  # experts stored one by one, as transformers saves them: read into the packed weight
        except ValueError as e:
            raise ConfigError(f"model_name_or_path = {directory!r}: {e}") from None
        if name not in stored:
            raise ConfigError(f"model_name_or_path = {directory!r}: no weight {name!r} in its safetensors, which the "
                              f"model its config.json describes needs ({len(stored)} weights found there)")
        shape, file, _ = stored[name]
        if shape != tuple(param.shape):
            raise ConfigError(f"model_name_or_path = {directory!r}: weight {name!r} has shape {list(shape)} in {file}, "
                              f"but its config.json makes it {list(param.shape)}")


def _model_names(model: nn.Module, stored: dict[str, tuple]) -> dict[str, tuple]:
    """`stored` by the names of `model`'s own weights: {model name: (shape, file, stored name)}.

    transformers saves some families under other names than their modules have (a Qwen-VL
    model's `model.layers.*` and `visual.*` are `model.language_model.layers.*` and
    `model.visual.*` once built) and renames them as it loads; its own renaming rules for
    the model (`transformers.conversion_mapping`) say how, and are applied here the same way.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [r for r in get_model_conversion_mapping(model) if isinstance(r, WeightRenaming)]
    return {rename_source_key(key, renamings, [])[0] if renamings else key: (*value, key)
            for key, value in stored.items()}


def _stored_shapes(directory: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{weight name: (shape, file name)} over the safetensors files of `directory`, from their headers."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in Path(directory).glob("*.bin"))
        hint = (f"; it has {', '.join(pickled)}: hp reads safetensors only (save the model with "
                "save_pretrained(dir), which writes them)") if pickled else ""
        raise ConfigError(f"model_name_or_path = {directory!r} holds no *.safetensors weights{hint}")
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({k: (tuple(f.get_slice(k).get_shape()), file.name) for k in f.keys()})  # noqa: SIM118 (safe_open is no dict)
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"model_name_or_path = {directory!r}: {file.name} is not a readable safetensors file "
                              f"({e})") from None
    return shapes


def _loaded_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers a HF directory stores for `model` (a tied output layer is stored once).

    hp's own routing bias is not among them: a run from HF weights starts it at zero; nor are LoRA's
    adapters, which start as `hp.add_lora` starts them, nor a reward model's value head.
    """
    state = {k: v for k, v in model.state_dict().items() if not _started_here(k)}
    for tied, source in _tied_weights(model).items():
        if source in state:  # loading the source fills both; a pipeline's last stage holds the tied one alone
            state.pop(tied, None)
    return state


def _started_here(name: str) -> bool:
    """Whether the parameter or buffer `name` starts in hp, not from the files: the routing bias, a LoRA
    adapter, a value head."""
    return name.endswith(f".{ROUTING_BIAS}") or is_adapter(name) or name.startswith(f"{VALUE_HEAD}.")


def _tied_weights(model: nn.Module) -> dict[str, str]:
    """{tied weight: the weight it shares, as the files store it} (HF's head tied to its embedding)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    return dict(getattr(model, "all_tied_weights_keys", None) or {"lm_head.weight": "model.embed_tokens.weight"})


def resolved_strategy(config: TrainConfig, hf_config) -> Strategy:
    """The config's strategy, with `parallel.tp2d`'s `scheme: auto` decided for the model's shapes
    (`hp.Strategy.resolved`) over the tokens of one data-parallel rank's micro-batch at its longest
    (per_device_train_batch_size * cutoff_len): the launcher and every worker decide alike.

    >>> from hp.train.config import validate
    >>> from hp.train.data.embedded import tiny_llama_config
    >>> config = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o",
    ...                    "parallel": {"tp2d": {"x": 2, "y": 2, "scheme": "auto"}}, "cutoff_len": 64,
    ...                    "per_device_train_batch_size": 32})
    >>> resolved_strategy(config, tiny_llama_config(259)).tp2d
    TP2D(x=2, y=2, z=1, scheme='summa')
    """
    tokens = config.per_device_train_batch_size * config.cutoff_len
    return config.parallel.resolved(hf_config, tokens)


def _given(strategy: Strategy) -> str:
    """The strategy's fields that differ from the defaults, as a config would write them."""
    default = Strategy().as_dict()
    return ", ".join(f"{k}={v}" for k, v in strategy.as_dict().items() if default[k] != v) or "one device"


def build_model(name_or_path: str, vocab_size: int, mesh, strategy: Strategy, *, seed: int,
                finetuning: Finetuning = Finetuning(), value_head: bool = False) -> nn.Module:
    """The model of `name_or_path`, laid out by `strategy` on `mesh` with its family's plan, on the mesh's device.

    `finetuning` adds adapters or freezes weights first (`hp.train.finetuning`); adapters of a
    model read from files start as `hp.add_lora` starts them, drawn from `seed`. `value_head`
    adds a reward model's (the module docstring).

    >>> import hp
    >>> mesh = hp.mesh(tp=1, simulate=True)
    >>> model = build_model("hp/tiny-llama", 259, mesh, Strategy(), seed=0)
    >>> model.config.hidden_size
    128
    """
    from hp.models import plan_for

    config = model_config(name_or_path, vocab_size)
    plan = plan_for(config)
    if name_or_path in EMBEDDED:
        torch.manual_seed(seed)  # the same initial weights on every rank and in every run
        model = model_class(config).from_config(config)
        apply_finetuning(model, finetuning, plan.blocks)
        if value_head:
            add_value_head(model, seed)
        return _lay_out(model, mesh, strategy, plan).to(mesh.device_type)
    with _parameters_on_meta():
        model = model_class(config).from_config(config)
        apply_finetuning(model, finetuning, plan.blocks)
    # a value head is drawn for real and kept whole: to_empty drops what the parameters held
    drawn = {f"{VALUE_HEAD}.{n}": p.detach().clone() for n, p in add_value_head(model, seed).named_parameters()
             } if value_head else {}
    computed = _non_persistent_buffers(model)  # RoPE's frequencies, Gemma's embedding scale: not in the files
    _lay_out(model, mesh, strategy, plan)
    to_empty(model, mesh.device_type)  # a head tied to its embedding stays one tensor, which loading fills
    buffers = dict(model.named_buffers())
    for name, value in computed.items():
        if name in buffers:  # a pipeline stage holds only its own modules' buffers
            buffers[name].copy_(value)
    check_loaded(model, load_safetensors(model, name_or_path), name_or_path)
    start_adapters(model, seed)
    for name, whole in drawn.items():
        copy_whole(model.get_parameter(name), whole)
    return model


def _lay_out(model: nn.Module, mesh, strategy: Strategy, plan) -> nn.Module:
    """`model` laid out by `strategy`; under pipeline parallel, cut to this rank's stage first (one stage per
    rank in `hp train`: the pipeline is `hp.parallel.pipeline.pipeline_of(model)`); under mpmd.place, as it is."""
    if strategy.mpmd_place is not None:  # cut into programs later, by hp.train.placed
        return model
    if strategy.pp > 1:
        pipeline(model, mesh, strategy, plan, device=torch.device(mesh.device_type))
        return model
    return apply_strategy(model, mesh, strategy, plan)


def add_value_head(model: nn.Module, seed: int) -> nn.Module:
    """Give `model` a reward model's value head (`VALUE_HEAD`), drawn as `nn.Linear` draws under `seed`.

    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> head = add_value_head(AutoModelForCausalLM.from_config(tiny_config("llama", layers=1)), seed=0)
    >>> head.weight.shape, head.weight.requires_grad
    (torch.Size([1, 64]), True)
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(model.config.get_text_config().hidden_size, 1)
    model.add_module(VALUE_HEAD, head)
    setattr(model, USED_OUTSIDE_FORWARD, True)  # the objective runs the head on hidden states: the DTensor path
    return head


def freeze_parts(model: nn.Module, *, vision_tower: bool, projector: bool, language_model: bool) -> list[str]:
    """Keep the weights of a vision-language model's parts (LlamaFactory's freeze_* keys); the frozen parts' names.

    The parts are its family plan's: the vision tower (`ModelPlan.vision`) without the projector
    (`ModelPlan.projector`), the projector, and the language model (every other weight: the decoder and
    the head). A frozen weight gets no gradient, so the optimizer leaves it. A text model is left as it is.

    >>> import hp
    >>> model = build_model("hp/tiny-qwen2.5-vl", 265, hp.mesh(tp=1, simulate=True), Strategy(), seed=0)
    >>> freeze_parts(model, vision_tower=True, projector=False, language_model=False)
    ['vision_tower']
    >>> model.model.visual.blocks[0].attn.qkv.weight.requires_grad, model.model.visual.merger.mlp[0].weight.requires_grad
    (False, True)
    """
    from hp.models import plan_for

    plan = plan_for(model.config)
    if plan.vision is None:
        return []
    frozen = {"vision_tower": vision_tower, "projector": projector, "language_model": language_model}

    def part(name: str) -> str:
        within = lambda prefix: name.startswith(prefix + ".")  # noqa: E731
        if any(within(p) for p in plan.projector):
            return "projector"
        return "vision_tower" if within(plan.vision) else "language_model"

    for name, param in model.named_parameters():
        if frozen[part(name)]:
            param.requires_grad_(False)
    return [name for name, on in frozen.items() if on]


def load_safetensors(model: nn.Module, directory: str) -> set[str]:
    """Fill `model`'s (possibly sharded) parameters from HF safetensors, each rank reading its own blocks; the
    names of the parameters and buffers read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from hp.train.checkpoint import distributed

    wanted = _loaded_state(model)
    read = set(wanted)
    stored = _model_names(model, _stored_shapes(directory))
    for tied, source in _tied_weights(model).items():  # stored once, under the weight it shares
        if tied in wanted and tied not in stored and source in stored:
            stored[tied] = stored[source]
    parts = expert_weights.parts_of(model)
    for name, param in list(wanted.items()):
        keys = expert_weights.one_by_one(name, tuple(param.shape), stored, parts)
        if keys:
            expert_weights.load(model.get_parameter(name), keys, stored, directory)
            del wanted[name]
    as_stored = {stored[name][2]: tensor for name, tensor in wanted.items()}  # the files' names
    state = to_storable(as_stored)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory), no_dist=not distributed())
    loaded = from_storable(state, as_stored)
    model.load_state_dict({name: loaded[stored[name][2]] for name in wanted}, strict=False)
    return read


def check_loaded(model: nn.Module, read: set[str], directory: str) -> None:
    """Refuse `model` when one of its parameters was neither read from `directory`, nor tied to one that was,
    nor started on purpose (a LoRA adapter, a value head): a run would train a model that is not the
    checkpoint's, with no message.

    >>> check_loaded(torch.nn.Linear(2, 2), {"weight"}, "/models/m")
    Traceback (most recent call last):
    ...
    hp.train.model.LoadError: model_name_or_path = '/models/m': the model's 'bias' was not in the checkpoint and is not tied to a parameter that was
    """
    for names in names_by_parameter(model):  # a tied parameter is read under any of its names
        if any(name in read or _started_here(name) for name in names):
            continue
        source = _tied_weights(model).get(names[0])
        tied = f"is not tied to {source!r}, which was" if source else "is not tied to a parameter that was"
        raise LoadError(f"model_name_or_path = {directory!r}: the model's {names[0]!r} was not in the checkpoint "
                        f"and {tied}")


@contextmanager
def _parameters_on_meta():
    """Build modules with parameters on the meta device but real buffers (computed in __init__, never loaded)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict leaves out, by name (their values come from the model's code)."""
    found = {}
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            if module._buffers.get(name) is not None:
                found[f"{prefix}.{name}" if prefix else name] = module._buffers[name].clone()
    return found
