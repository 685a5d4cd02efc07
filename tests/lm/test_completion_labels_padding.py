"""completion_labels masks padding, so HF's own loss on its labels is the completion-only loss."""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tests.lm_helpers import next_token_reference, params_of, tiny_gpt2, token_batch

PROMPT = torch.tensor([3, 2, 4, 1])


def test_hf_loss_on_completion_labels_equals_the_completion_only_loss():
    model = tiny_gpt2()
    batch = token_batch(n=4, length=10)
    labels = tif.completion_labels(batch, PROMPT)
    assert (labels[batch["attention_mask"] == 0] == tif.lm.IGNORE_INDEX).all()
    ours = tif.causal_lm_loss(model)
    for i in range(4):
        row = {key: value[i] for key, value in batch.items()} | {"labels": labels[i]}
        # HF scores every label that is not -100 (the attention mask does not hide labels);
        # it computes its loss in float32 whatever the model's dtype.
        outputs = model(input_ids=row["input_ids"][None],
                        attention_mask=row["attention_mask"][None], labels=row["labels"][None])
        reference = next_token_reference(outputs, {k: v[None] for k, v in row.items()})
        torch.testing.assert_close(outputs.loss.double(), reference, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours(params_of(model), row), reference, rtol=1e-10,
                                   atol=1e-12)
        if row["attention_mask"].all():
            continue
        # Labels that leave the padding in (the old behaviour) give HF another loss.
        unmasked = tif.completion_labels(row["input_ids"], PROMPT[i])
        padded = model(input_ids=row["input_ids"][None],
                       attention_mask=row["attention_mask"][None], labels=unmasked[None]).loss
        assert abs(padded.double() - reference) > 1e-3


def test_padding_from_the_mask_or_the_pad_id():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[-100, -100, 7, 8, -100, -100], [-100, -100, 7, 8, 9, 1]])
    assert torch.equal(tif.completion_labels(ids, 2, attention_mask=mask), expected)
    assert torch.equal(tif.completion_labels(ids, 2, pad_token_id=0), expected)
    assert torch.equal(tif.completion_labels({"input_ids": ids, "attention_mask": mask}, 2),
                       expected)
    # Without either, nothing tells padding apart (as before).
    assert torch.equal(tif.completion_labels(ids, 2)[0, 4:], ids[0, 4:])
    with pytest.raises(tif.errors.InvalidArgumentError, match="attention_mask has shape"):
        tif.completion_labels(ids, 2, attention_mask=mask[:, :3])
