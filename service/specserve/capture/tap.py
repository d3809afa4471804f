"""Taking a sampled request's token ids from the engine's answer as it passes to the client.

The arm's front asks vLLM for the token ids of a sampled request (`return_token_ids`); vLLM
then puts the prompt's ids (as the engine saw them: the chat template applied) and each
choice's output ids into the answer: on the response or its first chunk (chat), on each choice
(completions), and each chunk's new ids on its choices. The tap collects them and takes them
out again, unless the client asked for them itself, so the client's answer is what it would
have been (with `return_token_ids`, vLLM also sends a chunk for tokens that add no text yet;
those are dropped).
"""

from __future__ import annotations

from typing import Any

from specserve.capture.store import Record

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")  # what decides how drafts are accepted


def sampling_of(body: Any) -> dict[str, float]:
    """The sampling fields a validated request set; those it left out take the engine's
    defaults (the model's generation config, else vLLM's)."""
    found = {}
    for name in SAMPLING_FIELDS:
        value = getattr(body, name, None)
        if value is not None:
            found[name] = float(value)
    return found


# Chunk fields that carry something for the client besides the choices' deltas.
_CHUNK_CONTENT = ("usage", "metrics")
_CHOICE_CONTENT = ("finish_reason", "logprobs", "stop_reason")


class Tap:
    def __init__(
        self,
        arm: str,
        endpoint: str,
        *,
        client_asked: bool,
        stream: bool,
        sampling: dict[str, float] | None = None,
        key: str | None = None,
        prompt_digest: str | None = None,
    ) -> None:
        self.arm, self.endpoint, self.client_asked = arm, endpoint, client_asked
        self.sampling, self.key, self.prompt_digest = sampling, key, prompt_digest
        # vLLM's stream chunks name the id fields (null) even when no ids were asked for; a
        # whole answer is sent without null fields.
        self._blank = _set_null if stream else _remove
        self._prompt: list[int] | None = None  # chat: one prompt for every choice
        self._prompts: dict[int, list[int]] = {}  # completions: each choice's own
        self._outputs: dict[int, list[int]] = {}
        self._finish: dict[int, str | None] = {}

    def take(self, payload: dict[str, Any]) -> bool:
        """Collect the ids of one response or stream chunk (as JSON), and remove them unless the
        client asked for them; False for a chunk left with nothing for the client."""
        keep = self.client_asked
        ids = payload.get("prompt_token_ids")
        if ids is not None:
            self._prompt = list(ids)
            if not keep:
                self._blank(payload, "prompt_token_ids")
        useful = any(payload.get(key) is not None for key in _CHUNK_CONTENT)
        for choice in payload.get("choices") or ():
            index = int(choice.get("index", 0))
            prompt = choice.get("prompt_token_ids")
            if prompt is not None:
                self._prompts[index] = list(prompt)
            self._outputs.setdefault(index, []).extend(choice.get("token_ids") or ())
            if choice.get("finish_reason") is not None:
                self._finish[index] = choice["finish_reason"]
            if not keep:
                for key in ("prompt_token_ids", "token_ids"):
                    if key in choice:
                        self._blank(choice, key)
            useful = useful or _has_content(choice)
        return keep or useful or "choices" not in payload

    def records(self) -> list[Record]:
        """One record per choice that has a prompt and ended."""
        found = []
        for index, output in sorted(self._outputs.items()):
            prompt = self._prompts.get(index, self._prompt)
            if prompt is None or index not in self._finish:
                continue
            found.append(
                Record(
                    arm=self.arm,
                    endpoint=self.endpoint,
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    finish_reason=self._finish[index],
                    sampling=self.sampling,
                    key=self.key,
                    prompt_digest=self.prompt_digest,
                )
            )
        return found


def _has_content(choice: dict[str, Any]) -> bool:
    if any(choice.get(key) is not None for key in _CHOICE_CONTENT):
        return True
    if choice.get("text"):  # completions
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat: role, content, reasoning, tool calls
        return any(value for value in delta.values())
    return "message" in choice  # a whole answer's choice


def _set_null(container: dict[str, Any], key: str) -> None:
    container[key] = None


def _remove(container: dict[str, Any], key: str) -> None:
    del container[key]
