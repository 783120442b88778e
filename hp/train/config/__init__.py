"""The configuration of `hp train`: one YAML file, checked whole before any worker starts.

A training run spends its first minutes launching workers, building the
mesh and loading weights, so a mistake in its config should cost nothing
and be reported once, in the launching shell, not N times from N ranks.
This package reads the file, applies command-line overrides, checks every
key and returns a frozen `TrainConfig` whose values are already of the
right type and range, and whose `parallel` is the `hp.Strategy` that the
launcher, the trainer and the model plans take (`hp.Strategy` checks the
parallel rules themselves; this package says where a refused value came
from). Every mistake raises `ConfigError` (a `ValueError`) whose message
names the key, the value given and what is allowed; an unknown key comes
with the closest known one.

The keys are LlamaFactory's (`model_name_or_path`, `stage`, `dataset`,
`cutoff_len`, `learning_rate`, ...), plus a `parallel:` section (dp, tp,
cp, sp, fsdp, ...) and the launcher's keys (`nproc_per_node`, `nnodes`,
...). Its modules, from the bottom up:

    templates          LlamaFactory's chat templates by name, as values (the `template` key's choices)
    schema             `TrainConfig`, `Preference`, `ConfigError` and the values keys may take
    rules              each key's type and range, one value checked, an unknown key's closest match
    llamafactory_keys  LlamaFactory's keys hp train takes no setting from: a note or a refusal each
    sharding_keys      DeepSpeed's and HF Trainer's fsdp sharding settings as strategy fields
    fold               the strategy fields gathered from every key that sets one
    hyper_parallel     LlamaFactory's HyperParallel keys (`use_hyper_parallel`, `hyper_parallel_args`)
    parallel           the `parallel:` section and the other sharding keys folded into one strategy
    validation         `validate`: every key checked, the mistakes listed together
    overrides          command-line `key=value` overrides
    files              `load_config` from YAML, and `to_dict` back

What it may import: no torch (it runs in the launching shell before any
worker, and a test holds it to this), and of hp only the torch-free
`hp.parallel.strategy` and `hp.parallel.finetune`; nothing else of
`hp.train`, which builds on it (the data layer, the model, the loop).
"""

from hp.parallel.strategy import DTYPES

from hp.train.config.files import load_config, to_dict
from hp.train.config.hyper_parallel import read_hyper_parallel_args, strategy_labels
from hp.train.config.overrides import apply_overrides
from hp.train.config.schema import (
    ACTIVATION_MODES, DEFAULT_MASTER_PORT, DEVICES, EVAL_STRATEGIES, PAIRWISE_STAGES, PREFERENCE_STAGES, RESUME_LAST,
    SCHEDULERS, STAGES, TEMPLATES, ConfigError, Preference, TrainConfig,
)
from hp.train.config.validation import validate

__all__ = [
    "ACTIVATION_MODES", "DEFAULT_MASTER_PORT", "DEVICES", "DTYPES", "EVAL_STRATEGIES", "PAIRWISE_STAGES",
    "PREFERENCE_STAGES", "RESUME_LAST", "SCHEDULERS", "STAGES", "TEMPLATES",
    "ConfigError", "Preference", "TrainConfig",
    "apply_overrides", "load_config", "read_hyper_parallel_args", "strategy_labels", "to_dict", "validate",
]
