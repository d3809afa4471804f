"""The trainer on a tiny drafter and synthetic sequences: offline acceptance, validation and
early stopping, resuming."""

import json
import pickle
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from specserve.drafter.model import Drafter, DrafterConfig
from specserve.drafter.pipeline import split_validation
from specserve.drafter.train import (
    TrainConfig,
    answer_labels,
    batch_loss,
    captured_rms,
    collate,
    load_records,
    offline_acceptance,
    plan_forwards,
    sequence_batch,
    train,
)

TINY = DrafterConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=50,
    draft_vocab_size=50,
    aux_layer_ids=(1, 2, 3),
)


def drafter() -> Drafter:
    torch.manual_seed(0)
    model = Drafter(TINY)
    model.set_draft_vocab(torch.arange(50))
    return model


def sequence(seed: int, length: int = 40) -> dict:
    """A counting sequence (token t+1 follows t) whose aux states encode the current token:
    learnable, so training has something to get right."""
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, 50, (1,), generator=g))
    ids = (torch.arange(length) + start) % 50
    aux = torch.nn.functional.one_hot(ids, 96).float() + 0.1 * torch.randn(length, 96, generator=g)
    return {"input_ids": ids.to(torch.int32), "aux": aux.bfloat16(), "answer_start": 8}


def test_offline_acceptance_chains_steps():
    result = offline_acceptance(drafter(), [sequence(i) for i in range(3)], steps=3)
    assert result.tokens == 3 * (40 - 8)
    assert all(c <= s + 1e-6 for c, s in zip(result.chain, result.step_top1, strict=True))
    assert result.chain == sorted(result.chain, reverse=True)
    assert result.mean_acceptance_length == 1 + sum(result.chain)


def test_captured_rms_measures_each_layer_on_its_own():
    g = torch.Generator().manual_seed(0)
    records = [
        {"aux": torch.cat([scale * torch.randn(30, 64, generator=g) for scale in (1, 5, 20)], -1)}
        for _ in range(4)
    ]
    assert captured_rms(records, 3) == pytest.approx([1, 5, 20], rel=0.05)


def test_training_learns_validates_and_ends_on_the_best_weights(tmp_path):
    records, validation = [sequence(i) for i in range(20)], [sequence(100 + i) for i in range(4)]
    before = offline_acceptance(drafter(), validation, steps=3).mean_acceptance_length
    config = TrainConfig(epochs=3, tokens_per_update=64, lr=1e-2, validate_every=10)
    model = train(drafter(), records, tmp_path, config, validation=validation)

    history = json.loads((tmp_path / "validation.json").read_text())
    total = int(3 * 20 * 32 / 64)
    assert [h["update"] for h in history] == [0, *range(10, total, 10), total]
    lengths = [1 + sum(h["chain"]) for h in history]
    assert lengths[0] == pytest.approx(before)  # where it started is the curve's origin
    after = offline_acceptance(model, validation, steps=3).mean_acceptance_length
    assert after > before + 0.5  # it learned to count
    assert abs(after - max(lengths)) < 1e-6  # and kept its best validated weights

    # Continuing with a learning rate that only does harm ends on the weights it started from.
    start = {name: t.clone() for name, t in model.state_dict().items()}
    harmful = TrainConfig(updates=5, tokens_per_update=64, lr=50.0, warmup_fraction=0)
    continued = train(model, records, tmp_path / "continued", harmful, validation=validation)
    lengths = [
        1 + sum(h["chain"])
        for h in json.loads((tmp_path / "continued" / "validation.json").read_text())
    ]
    assert len(lengths) == 2 and lengths[1] < lengths[0]
    for name, tensor in continued.state_dict().items():
        torch.testing.assert_close(tensor, start[name])


class SlowList(list):
    """Records whose every read takes a little time, so a deadline comes mid-run."""

    def __getitem__(self, index):
        time.sleep(0.01)
        return super().__getitem__(index)


def test_training_stops_at_its_deadline_validated_checkpointed_and_on_its_best_weights(tmp_path):
    records, validation = (
        SlowList(sequence(i) for i in range(20)),
        [sequence(100 + i) for i in range(4)],
    )
    config = TrainConfig(updates=1000, tokens_per_update=64, lr=1e-2, validate_every=400)
    model = train(
        drafter(), records, tmp_path, config, validation=validation, deadline=time.monotonic() + 1
    )
    history = json.loads((tmp_path / "validation.json").read_text())
    stopped = history[-1]["update"]
    assert 0 < stopped < 1000  # ~50 updates of 2 reads at 10 ms
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["update"] == stopped
    best = max(1 + sum(h["chain"]) for h in history)
    after = offline_acceptance(model, validation, steps=3).mean_acceptance_length
    assert after == pytest.approx(best)


class Interrupted(Exception):
    pass


class InterruptingList(list):
    """Records that stop the run (like Ctrl-C) at the `limit`-th sequence read."""

    def __init__(self, items, limit: int) -> None:
        super().__init__(items)
        self.reads, self.limit = 0, limit

    def __getitem__(self, index):
        self.reads += 1
        if self.reads == self.limit:
            raise Interrupted
        return super().__getitem__(index)


def test_training_resumes_from_its_checkpoint(tmp_path):
    records = [sequence(i) for i in range(10)]
    config = TrainConfig(epochs=2, tokens_per_update=64, checkpoint_every=2, validate_every=3)
    validation = [sequence(100)]
    straight = train(drafter(), records, tmp_path / "a", config, validation=validation)
    # Two sequences per update: the 11th read is in update 6, after the checkpoint at 4.
    with pytest.raises(Interrupted):
        train(
            drafter(), InterruptingList(records, 11), tmp_path / "b", config, validation=validation
        )
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["update"] == 4
    resumed = train(drafter(), records, tmp_path / "b", config, validation=validation)
    for name, tensor in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor)
    assert (tmp_path / "a" / "validation.json").read_text() == (
        tmp_path / "b" / "validation.json"
    ).read_text()


def test_validation_split_is_stable_and_about_four_percent():
    records = [{"input_ids": torch.arange(i, i + 20, dtype=torch.int32)} for i in range(2000)]
    training, validation = split_validation(records)
    assert 40 < len(validation) < 130 and len(training) + len(validation) == 2000
    assert split_validation(records)[1] == validation


def test_final_states_line_up_with_the_label_they_predict():
    record = sequence(0)
    record["final"] = torch.arange(40, dtype=torch.bfloat16)[:, None].expand(40, 4)
    _, _, labels, finals, _ = sequence_batch(record, steps=3, max_len=1 << 30)
    for j in range(3):
        # Step j's label at index t is token t + 2 + j, predicted by the target at t + 1 + j.
        assert labels[j][0, 10] == record["input_ids"][12 + j]
        assert finals[j][0, 10, 0] == 11 + j
    assert finals[2][0, -1].abs().sum() == 0  # past the sequence: padding (its label is ignored)


def test_soft_labels_of_a_certain_teacher_train_like_hard_labels(tmp_path):
    """A teacher whose distribution is all on the greedy token gives the hard-label update; a
    teacher on other tokens pulls the drafter elsewhere."""
    head = torch.eye(50)  # the target's output rows: its logits are final @ head.T
    records = []
    for i in range(6):
        record = sequence(i)
        # Final state at position p: all on token p + 1 (the greedy token that follows).
        following = torch.cat([record["input_ids"][1:].long(), torch.zeros(1, dtype=torch.long)])
        record["final"] = 40 * torch.nn.functional.one_hot(following, 50).bfloat16()
        records.append(record)
    config = TrainConfig(epochs=2, tokens_per_update=64, lr=1e-2, checkpoint_every=1000)
    hard = train(drafter(), records, tmp_path / "hard", config)
    soft_config = TrainConfig(**{**asdict(config), "soft_labels": 1.0})
    soft = train(drafter(), records, tmp_path / "soft", soft_config, target_head=head)
    for name, tensor in hard.state_dict().items():
        torch.testing.assert_close(soft.state_dict()[name], tensor, atol=1e-4, rtol=1e-3)
    for record in records:  # a teacher that disagrees with the greedy tokens
        record["final"] = record["final"].roll(1, dims=-1)
    other = train(drafter(), records, tmp_path / "other", soft_config, target_head=head)
    assert (other.lm_head.weight - hard.lm_head.weight).abs().max() > 1e-2


def uneven(seed: int) -> dict:
    """A counting sequence of its own length and answer start, with final states."""
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(20, 60, (1,), generator=g))
    record = sequence(seed, length)
    record["answer_start"] = int(torch.randint(2, length - 5, (1,), generator=g))
    record["final"] = torch.randn(length, 50, generator=g).bfloat16()
    return record


@pytest.mark.parametrize("max_len", [1 << 30, 30, 12])
def test_answer_labels_counts_what_step_one_learns(max_len):
    for seed in range(30):
        record = uneven(seed)
        _, _, labels, _, _ = sequence_batch(record, steps=3, max_len=max_len)
        assert answer_labels(record, max_len) == int((labels[0] >= 0).sum())


@pytest.mark.parametrize("max_len", [1 << 30, 30, 12])
def test_a_batch_holds_each_sequence_as_it_is_alone(max_len):
    """`collate` builds in whole-batch operations what `sequence_batch` makes of each record:
    the same states, inputs, labels and final states, padded past each sequence's end."""
    records = [uneven(seed) for seed in range(7)]
    batch = collate(records, 3, max_len, with_finals=True)
    assert batch.answer_tokens == sum(answer_labels(r, max_len) for r in records)
    for b, record in enumerate(records):
        aux, inputs, labels, finals, first = sequence_batch(record, 3, max_len)
        n = aux.shape[1]
        assert first >= batch.first
        torch.testing.assert_close(batch.aux[b, :n], aux[0], rtol=0, atol=0)
        assert batch.aux[b, n:].abs().sum() == 0
        assert torch.equal(batch.inputs[b, : inputs.shape[1]], inputs[0])
        assert (batch.inputs[b, inputs.shape[1] :] == 0).all()
        for j in range(3):
            alone = labels[j][0, batch.first :]
            assert torch.equal(batch.labels[j][b, : alone.numel()], alone)
            assert (batch.labels[j][b, alone.numel() :] == -100).all()
            torch.testing.assert_close(
                batch.finals[j][b, : alone.numel()], finals[j][0, batch.first :], rtol=0, atol=0
            )


def test_forwards_group_by_length_within_the_budget():
    lengths = [50, 10, 40, 12, 300, 11]
    groups = plan_forwards(lengths, batch_tokens=100)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert [300] in [[lengths[i] for i in g] for g in groups]  # too long: alone
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or len(group) * longest <= 100
        assert longest == lengths[group[0]]  # longest first
    assert plan_forwards(lengths, 0) == [[4], [0], [2], [3], [5], [1]]


@pytest.fixture
def float32(monkeypatch):
    """No bf16 autocast: exact comparisons between batch shapes."""
    monkeypatch.setattr("specserve.drafter.train.fast_dtype", lambda: "float32")


def test_a_padded_batch_has_the_loss_and_gradients_of_its_sequences_one_by_one(float32):
    records = [uneven(seed) for seed in range(5)]
    head = torch.randn(50, 50)
    weights = [1.0, 0.8, 0.64]

    def loss_and_grads(batches):
        model = drafter()
        total = torch.zeros(())
        right, seen = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        for batch in batches:
            loss, r, s = batch_loss(model, batch, weights, 0.3, head)
            loss.backward()
            total, right, seen = total + loss.detach(), right + r, seen + s
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return total, right, seen, grads

    together = loss_and_grads([collate(records, 3, 1 << 30, with_finals=True)])
    alone = loss_and_grads([collate([r], 3, 1 << 30, with_finals=True) for r in records])
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-4)
    assert together[1].tolist() == alone[1].tolist()
    assert together[2].tolist() == alone[2].tolist()
    assert together[2][0] == sum(answer_labels(r, 1 << 30) for r in records)
    for name, grad in alone[3].items():
        torch.testing.assert_close(together[3][name], grad, rtol=1e-4, atol=1e-5)


def test_batched_training_takes_the_updates_of_one_sequence_at_a_time(float32, tmp_path):
    records = [uneven(seed) for seed in range(12)]
    validation = [uneven(100 + seed) for seed in range(3)]
    config = TrainConfig(epochs=2, tokens_per_update=48, lr=1e-2, validate_every=4)
    batched = train(drafter(), records, tmp_path / "batched", config, validation=validation)
    single = TrainConfig(**{**asdict(config), "batch_tokens": 0})
    one_by_one = train(drafter(), records, tmp_path / "single", single, validation=validation)
    for name, tensor in one_by_one.state_dict().items():
        torch.testing.assert_close(batched.state_dict()[name], tensor, rtol=1e-3, atol=1e-4)
    curves = [
        json.loads((tmp_path / run / "validation.json").read_text())
        for run in ("batched", "single")
    ]
    assert [h["update"] for h in curves[0]] == [h["update"] for h in curves[1]]
    for a, b in zip(*curves, strict=True):
        assert a["chain"] == pytest.approx(b["chain"], abs=1e-6)


def test_offline_acceptance_is_the_same_batched_or_not():
    records = [uneven(seed) for seed in range(7)]
    batched = offline_acceptance(drafter(), records, steps=3, batch_tokens=4096)
    single = offline_acceptance(drafter(), records, steps=3, batch_tokens=0)
    assert batched.tokens == single.tokens
    assert batched.chain == pytest.approx(single.chain, abs=1e-6)


class _RunsCodeWhenLoaded:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_shard_that_would_run_code_when_loaded_is_refused(tmp_path):
    """Shards live on a volume other pods write: only tensors and plain data are read."""
    marker = tmp_path / "ran"
    shard = tmp_path / "shard-0.pt"
    torch.save([{"input_ids": torch.zeros(3), "kind": _RunsCodeWhenLoaded(marker)}], shard)
    with pytest.raises(pickle.UnpicklingError):
        load_records([shard])
    assert not marker.exists()
