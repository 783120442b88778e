"""Plain data parallel's cheaper shares, in one process: rows dealt out by padded tokens, and the LM head on
supervised positions only (the whole dp step runs on gloo in tests/workers/zoo_gloo.py, check_plain_dp)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from hp.models import tiny_config
from hp.parallel.plain_dp import _supervised_logits, balanced_rows, selects_logits
from hp.train.loop import adamw


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=64), st.data())
def test_balanced_rows_give_every_rank_rows_and_never_more_padding_than_equal_shares(widths, data):
    ranks = data.draw(st.integers(1, len(widths)))
    shares = balanced_rows(widths, ranks)
    assert len(shares) == ranks and all(shares)
    assert sorted(i for share in shares for i in share) == list(range(len(widths)))
    cost = max(len(share) * max(widths[i] for i in share) for share in shares)
    if len(widths) % ranks == 0:  # what equal shares in the batch's order cost
        size = len(widths) // ranks
        equal = max(size * max(widths[r * size:(r + 1) * size]) for r in range(ranks))
        assert cost <= equal


def test_the_head_on_supervised_positions_gives_the_whole_loss_and_gradients():
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    model.load_state_dict(reference.state_dict())
    assert selects_logits(model)
    ids = torch.randint(0, 256, (3, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    count = (labels[:, 1:] != -100).sum()
    want = reference(input_ids=ids, labels=labels, num_items_in_batch=count)
    cut = [False]
    kwargs = _supervised_logits({"input_ids": ids, "labels": labels, "num_items_in_batch": count}, cut)
    got = model(**kwargs)
    assert cut == [True] and got.logits.shape == (int(count), model.config.vocab_size)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    want.loss.backward()
    got.loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_model_without_hf_logit_slicing_keeps_its_whole_logits():
    assert not selects_logits(torch.nn.Linear(2, 2))
    labels = torch.tensor([[1, 2, -100]])
    assert _supervised_logits({"labels": labels, "logits_to_keep": 1}, [False])["logits_to_keep"] == 1


def test_adamw_is_fused_where_torch_has_the_kernel():
    params = [torch.nn.Parameter(torch.ones(2))]
    assert adamw(params).defaults["fused"]
    assert not adamw([torch.nn.Parameter(torch.ones(2, dtype=torch.long), requires_grad=False)]).defaults["fused"]
