"""The benchmark prompt set, turned into token prompts that every mode receives.

Prompts are tokenized once through the plain llama-server (`/apply-template` for
chat prompts, `/tokenize`), so plain, builtin and proxy all get identical token
ids. Padding to a context length prepends background text from the set's
`document` section; each prompt opens with its own id, so no two prompts share a
cached prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts.json"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    kind: str
    tokens: tuple[int, ...]


class ServerText:
    """Tokenizer helpers of a running llama-server."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.base_url + path, json=body) as response:
            response.raise_for_status()
            return await response.json()

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": True}
        return list((await self._post("/tokenize", body))["tokens"])

    async def detokenize(self, tokens: list[int]) -> str:
        return str((await self._post("/detokenize", {"tokens": tokens}))["content"])

    async def chat_prompt(self, text: str) -> str:
        """The server's own chat template around one user message (raw text without one)."""
        try:
            body = {"messages": [{"role": "user", "content": text}]}
            return str((await self._post("/apply-template", body))["prompt"])
        except (aiohttp.ClientError, KeyError):
            return text


def load_prompt_set(path: Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or DEFAULT_PROMPTS).read_text())


def document_text(paragraphs: list[str], start: int, n_sections: int) -> str:
    """Numbered sections cycling through the paragraphs, from paragraph `start`."""
    sections = []
    for i in range(n_sections):
        paragraph = paragraphs[(start + i) % len(paragraphs)]
        sections.append(f"Section {i + 1}. {paragraph}")
    return "\n\n".join(sections)


async def _render(server: ServerText, text: str, chat: bool) -> list[int]:
    return await server.tokenize(await server.chat_prompt(text) if chat else text)


async def _padded(
    server: ServerText, head: str, text: str, chat: bool, paragraphs: list[str], start: int,
    target: int,
) -> list[int]:  # fmt: skip
    """`head` + background document + `text`, about `target` tokens in all."""
    bare = await _render(server, f"{head}{text}", chat)
    budget = target - len(bare)
    if budget <= 8:
        return bare
    # Enough sections to cover the budget (paragraphs run ~60 tokens), then trim.
    doc = document_text(paragraphs, start, budget // 40 + 2)
    doc_tokens = await server.tokenize(doc, add_special=False)
    doc = await server.detokenize(doc_tokens[:budget])
    return await _render(server, f"{head}{doc}{text}", chat)


async def build_prompts(
    server: ServerText, prompt_set: dict[str, Any], context: int | None
) -> list[BenchPrompt]:
    """Token prompts for one context setting (None: prompts as written, long one at
    its own target length; N: every prompt padded to about N tokens)."""
    paragraphs = list(prompt_set["document"])
    out: list[BenchPrompt] = []
    for index, item in enumerate(prompt_set["prompts"]):
        chat = bool(item.get("chat", False))
        if context is None:
            tokens = await _render(server, item["text"], chat)
        else:
            head = f"Task {item['id']}. Background notes:\n\n"
            tokens = await _padded(
                server, head, "\n\n" + item["text"], chat, paragraphs, index, context
            )
        out.append(BenchPrompt(item["id"], item["kind"], tuple(tokens)))
    long = prompt_set.get("long")
    if long is not None:
        target = int(context or long["target_tokens"])
        tokens = await _padded(
            server, long["header"], long["question"], bool(long.get("chat")),
            paragraphs, 0, target,
        )  # fmt: skip
        out.append(BenchPrompt(long["id"], long["kind"], tuple(tokens)))
    return out


def select(prompts: list[BenchPrompt], ids: list[str] | None) -> list[BenchPrompt]:
    if not ids:
        return prompts
    known = {p.id for p in prompts}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValueError(f"unknown prompt ids {unknown}; known: {sorted(known)}")
    return [p for p in prompts if p.id in ids]
