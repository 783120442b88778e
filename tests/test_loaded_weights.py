"""A model read from a local HF directory is the checkpoint's model, under every strategy, tied or untied.

Each case is a directory that HF's `save_pretrained` wrote (its head tied to its
embedding or not), read by `hp train`'s loading path under one strategy: the
logits on a batch before any step are HF `from_pretrained`'s, and the first
three losses of `hp train` are those of HF's own step on the same batches
(AdamW, clipping, a constant rate). One launch runs every strategy of two ranks
(dp, tp, tp + sp, FSDP, pp, cp, ep), another data parallel on one process;
hypothesis draws the family and the fine-tuning of each case. A LoRA case's
adapters start at zero, so its logits and first loss are the base model's;
its later losses depend on the adapters' draw (a laid-out LoRA model against
an unsharded one: tests/test_lora.py). What a checkpoint lacks is refused before any
worker starts (`check_weights`), and a model whose loaded weights are not all
the checkpoint's is refused by name before its first step (`check_loaded`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from train_runs import DATA, QUICKSTART, hp_train, local_hf_model, losses, run_cases, summary

from hp.models import plan_for_type

DENSE = ("llama", "qwen2", "qwen3", "gemma", "gemma2")  # gemma2: a tied head after a softcap, sandwich norms
MOE = ("qwen3_moe",)
GLOBAL_BATCH = 8
STEPS = 3
# Each strategy of two ranks, as `hp train` overrides, with its data-parallel degree.
TWO_RANKS = {
    "dp": (2, ["parallel.dp=2"]),
    "tp": (1, ["parallel.tp=2"]),
    "tp_sp": (1, ["parallel.tp=2", "parallel.sp=true"]),
    "fsdp": (2, ["parallel.dp=2", "parallel.fsdp=true"]),
    "pp": (1, ["parallel.pp=2"]),
    "cp": (1, ["parallel.cp=2"]),
    "ep": (2, ["parallel.dp=2", "parallel.ep=2"]),
}
COMMON = ["parallel.tp=1", f"max_steps={STEPS}", "logging_steps=1", "save_steps=1000", "lr_scheduler_type=constant",
          "warmup_ratio=0", f"dataset_dir={DATA}"]


def _overrides(directory, dp: int, strategy: list[str], finetuning: str) -> list[str]:
    lora = ["finetuning_type=lora", "lora_target=all"] if finetuning == "lora" else []
    return [*COMMON, f"model_name_or_path={directory}", f"per_device_train_batch_size={GLOBAL_BATCH // dp}",
            *strategy, *lora]


def _global_batches(overrides: list[str]):
    """`hp train QUICKSTART *overrides`'s config, and its global batches in the order its steps draw them."""
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples, load_tokenizer

    config = load_config(QUICKSTART, overrides)
    tokenizer = load_tokenizer(config.model_name_or_path)
    return config, TokenBatches(load_examples(config, tokenizer), GLOBAL_BATCH, config.seed, tokenizer.pad_token_id)


def _hf_reference(directory, overrides: list[str], steps: int = STEPS) -> tuple[torch.Tensor, list[float]]:
    """HF `from_pretrained`'s logits on the worker's batch, and the losses of HF's own steps on `hp train`'s
    batches: the global batch's mean token loss, clipped gradients, AdamW at the config's rate."""
    from transformers import AutoModelForCausalLM
    from workers.loaded_gloo import batch

    config, batches = _global_batches(overrides)
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = model(input_ids=batch(model.config.vocab_size)).logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    losses = []
    for _ in range(steps):
        ids, labels = next(batches)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return logits, losses


def _check(directory, overrides: list[str], logits, losses: list[float], finetuning: str, case: str,
           references: dict) -> None:
    """`case`'s logits and losses against HF's; `references` keeps HF's by directory (every case draws the same
    global batches at the same rate, whatever its strategy and fine-tuning)."""
    if directory not in references:
        references[directory] = _hf_reference(directory, overrides)
    want_logits, want_losses = references[directory]
    if logits is not None:
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: {m}")
    compared = 1 if finetuning == "lora" else STEPS
    assert losses[:compared] == pytest.approx(want_losses[:compared], rel=1e-5), (case, losses, want_losses)


families = st.sampled_from(DENSE)
finetunings = st.sampled_from(("full", "lora"))


@settings(max_examples=1, phases=(Phase.explicit, Phase.generate))  # one example is 15 hp train runs: no shrinking
@given(draws=st.fixed_dictionaries({(strategy, tied): st.tuples(st.sampled_from(MOE) if strategy == "ep" else families,
                                                                  finetunings)
                                    for strategy in TWO_RANKS for tied in (True, False)}),
       alone=st.tuples(families, finetunings))
def test_a_saved_model_loads_as_hf_loads_it_under_every_strategy(tmp_path_factory, draws, alone):
    """Every strategy of two ranks, tied and untied, and data parallel on one process: HF's logits before any
    step and HF's first losses."""
    tmp_path = tmp_path_factory.mktemp("loaded")
    cases, checks = {}, {}
    for (strategy, tied), (family, finetuning) in draws.items():
        name = f"{strategy}_{'tied' if tied else 'untied'}"
        directory = tmp_path / f"{family}_{'tied' if tied else 'untied'}"
        if not directory.exists():
            local_hf_model(directory, family, tied=tied)
        dp, extra = TWO_RANKS[strategy]
        cases[name] = _overrides(directory, dp, extra, finetuning)
        checks[name] = (directory, finetuning)
    results = run_cases(tmp_path / "world2", 2, cases)
    family, finetuning = alone
    directory = tmp_path / f"{family}_tied"
    if not directory.exists():
        local_hf_model(directory, family, tied=True)
    alone_case = _overrides(directory, 1, [], finetuning)
    results.update(run_cases(tmp_path / "world1", 1, {"alone": alone_case}))
    cases["alone"], checks["alone"] = alone_case, (directory, finetuning)
    assert results.keys() == cases.keys()
    references: dict = {}
    for name, (logits, _, got) in results.items():
        directory, finetuning = checks[name]
        _check(directory, cases[name], logits, got, finetuning, name, references)


def test_the_families_drawn_tie_their_heads_as_hf_does(tmp_path):
    """A tied directory's head is its embedding in HF's model (what the cases above rely on), and the zoo lays
    out each family drawn."""
    from transformers import AutoModelForCausalLM

    for family in (*DENSE, *MOE):
        plan_for_type(family)
        local_hf_model(tmp_path / family, family, tied=True)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / family)
        assert model.lm_head.weight is model.get_input_embeddings().weight, family


@settings(max_examples=1, phases=(Phase.explicit, Phase.generate))
@given(family=families, strategy=st.sampled_from(("dp", "fsdp", "tp")))
def test_a_tied_model_resumes_and_exports_as_hf_trains_it(tmp_path_factory, family, strategy):
    """Two steps, saved; resumed for a third (under data parallel on one process: another strategy); the
    third step's checkpoint exported as a HF directory (`hp export`), which transformers loads tied: the
    third loss is HF's third, and the exported model's loss on the fourth batch is HF's fourth."""
    from transformers import AutoModelForCausalLM

    from hp.train.export import export

    tmp_path = tmp_path_factory.mktemp("resumed")
    directory = tmp_path / "model"
    local_hf_model(directory, family, tied=True)
    dp, extra = TWO_RANKS[strategy]
    first = [*_overrides(directory, dp, extra, "full"), "save_steps=2", f"output_dir={tmp_path / 'first'}"]
    summary(hp_train(*first, "max_steps=2"))
    resumed = [*_overrides(directory, 1, [], "full"), "max_steps=3", f"output_dir={tmp_path / 'resumed'}",
               f"resume_from_checkpoint={tmp_path / 'first' / 'checkpoint-2'}"]
    summary(hp_train(*resumed))
    _, want = _hf_reference(directory, first, steps=STEPS + 1)
    assert losses(tmp_path / "resumed")[3] == pytest.approx(want[2], rel=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(export(str(tmp_path / "resumed" / "checkpoint-3"),
                                                           str(tmp_path / "exported")))
    assert exported.lm_head.weight is exported.get_input_embeddings().weight
    _, batches = _global_batches(first)
    ids, labels = [next(batches) for _ in range(STEPS + 1)][-1]
    with torch.no_grad():
        assert exported(input_ids=ids, labels=labels).loss.item() == pytest.approx(want[3], rel=1e-5)


def test_a_head_left_untied_by_loading_is_refused_by_name(tmp_path):
    """What hp's loading did before it kept ties: a tied model built on the meta device and given memory by
    `nn.Module.to_empty`, whose head then is a tensor of its own that the files (holding the embedding
    alone) never fill. The check after loading names the head and the weight it should share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp.train.model import LoadError, check_loaded, load_safetensors

    local_hf_model(tmp_path, "qwen2", tied=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    model.to_empty(device="cpu")
    with pytest.raises(LoadError, match="the model's 'lm_head.weight' was not in the checkpoint and is not tied to "
                                        "'model.embed_tokens.weight', which was"):
        check_loaded(model, load_safetensors(model, str(tmp_path)), str(tmp_path))
