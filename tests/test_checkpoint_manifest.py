"""Checkpoints prove themselves: a damaged file is found by the manifest, `last` passes over it, a damaged
checkpoint named explicitly is refused by its file, and checkpoints without a manifest still load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from hp.models import tiny_config
from hp.train import checkpoint, manifest

KINDS = ["trainer_state.pt", ".metadata", "__0_0.distcp", "config.json"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """checkpoint-3 and checkpoint-6 of a tiny Llama and its AdamW state, written as hp train writes them."""
    out = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()
    for step in (3, 6):
        checkpoint.save(str(out), step, model, optimizer, {"scheduler": {}, "data": {}})
    return out


def test_a_background_save_writes_the_state_of_its_step_not_of_the_next_update(saved, tmp_path):
    """A background save returns before its files are written; the update that follows changes the weights
    in place, and the checkpoint still holds the weights of its step, bit for bit as a synchronous save's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()  # as `saved` did: its checkpoint-6 is this state, saved synchronously
    saver = checkpoint.Saver(str(tmp_path), background=True)
    saver.save(6, model, optimizer, {"scheduler": {}, "data": {}})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next update, while the checkpoint is being written
    assert saver.close() == str(tmp_path / "checkpoint-6")
    states = []
    for run in (saved, tmp_path):
        dcp_to_torch_save(run / "checkpoint-6", tmp_path / "state.pt")
        states.append(torch.utils._pytree.tree_flatten(torch.load(tmp_path / "state.pt")))
    assert states[0][1] == states[1][1]
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(states[0][0], states[1][0]))
    assert manifest.verify(str(tmp_path / "checkpoint-6")) is None


def _copy(saved: Path, tmp: Path) -> Path:
    out = tmp / "run"
    shutil.copytree(saved, out)
    return out


def test_every_file_of_a_checkpoint_is_in_its_manifest(saved):
    names = set(manifest._files(str(saved / "checkpoint-6")))
    assert set(KINDS) <= names
    assert manifest.verify(str(saved / "checkpoint-6")) is None
    assert checkpoint.latest(str(saved)) == str(saved / "checkpoint-6")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), cut=st.booleans(), where=st.floats(0, 1, exclude_max=True))
def test_a_damaged_newest_checkpoint_is_passed_over_and_refused_by_name(saved, tmp_path_factory, kind, cut, where):
    out = _copy(saved, tmp_path_factory.mktemp("damaged"))
    file = out / "checkpoint-6" / kind
    data = bytearray(file.read_bytes())
    at = int(where * len(data))
    if cut:
        data = data[:at]
    else:
        data[at] ^= 0x01
    file.write_bytes(bytes(data))
    skipped: list = []
    assert checkpoint.latest(str(out), skipped) == str(out / "checkpoint-3")
    assert [path for path, _ in skipped] == [str(out / "checkpoint-6")] and kind in skipped[0][1]
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint-6 is damaged: .*{kind}"):
        checkpoint.trainer_state(str(out / "checkpoint-6"))


def test_an_unreadable_manifest_is_damage_too(saved, tmp_path):
    out = _copy(saved, tmp_path)
    (out / "checkpoint-6" / manifest.MANIFEST).write_text('{"files": ')
    skipped: list = []
    assert checkpoint.latest(str(out), skipped) == str(out / "checkpoint-3")
    assert "manifest.json cannot be read" in skipped[0][1]


def test_a_checkpoint_written_before_manifests_still_loads(saved, tmp_path):
    out = _copy(saved, tmp_path)
    os.remove(out / "checkpoint-6" / manifest.MANIFEST)
    assert checkpoint.latest(str(out)) == str(out / "checkpoint-6")
    assert checkpoint.trainer_state(str(out / "checkpoint-6"))["step"] == 6


def test_no_good_checkpoint_left_is_none(saved, tmp_path):
    out = _copy(saved, tmp_path)
    for step in (3, 6):
        (out / f"checkpoint-{step}" / "config.json").write_text("{}")
    skipped: list = []
    assert checkpoint.latest(str(out), skipped) is None and len(skipped) == 2


def test_a_part_of_the_model_that_trains_nothing_saves_and_loads(tmp_path):
    """A rank whose part of the model is all frozen (a frozen vision tower placed beside the pipeline) has an
    AdamW over no weights: its checkpoint holds its weights, no optimizer state, and loads back."""
    config = tiny_config("llama", layers=1)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(config).requires_grad_(False))
    saved = checkpoint.save(str(tmp_path), 1, models[0], torch.optim.AdamW([{"params": []}]),
                            {"scheduler": {}, "data": {}})
    checkpoint.load(saved, models[1], torch.optim.AdamW([{"params": []}]))
    for (name, want), got in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(got, want), name
