"""Prepared models are served by another user than the one who prepared them."""

from __future__ import annotations

from specserve.models import readable_by_all


def test_a_prepared_model_is_readable_by_every_user(tmp_path):
    # The image prepares the model as root and serves it as uid 1000; the safetensors writer
    # leaves its file 0600, which made every engine fail with "Permission denied".
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    weights = model / "model.safetensors"
    weights.write_bytes(b"\0")
    weights.chmod(0o600)
    (model / "sub").chmod(0o700)

    readable_by_all(model)

    assert weights.stat().st_mode & 0o777 == 0o644
    assert (model / "sub").stat().st_mode & 0o777 == 0o755
