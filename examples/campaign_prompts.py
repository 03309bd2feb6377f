"""Prompts for the drafter campaign's regenerated data (`hf-diffspec data generate --source FILE`), weighted toward
what users ask and the benchmark measures: code (Python and other programming languages), math, chat, and other
natural languages. All from the ShareGPT wheel, evaluation prompts (HumanEval, MATH-500, MT-Bench) removed by text.

    python examples/campaign_prompts.py --out data/regen-mix-smollm2/prompts.jsonl

Each prompt gets a family (`code`, `code-other`, `math`, `chat`, `language`); the file is ordered so that every
prefix holds the families in the proportions of `--weights`, so a run stopped after N responses has a balanced mix,
and the list for a larger `--num` starts with the list for a smaller one, so a campaign can ask for more prompts.
Other natural languages are rare in ShareGPT's first turns (~200 of 17k), so for them every human turn counts (a
later turn alone is still a prompt in that language). Deterministic: the same wheel and seed give the same file.

With `--follow-ups DIR`, a conversation whose turn the target has answered in DIR also gives its next user turn, with
the target's own answers as the assistant's turns (`{"id", "messages", "domain"}`, id `sharegpt/RID/turn0>2`): ShareGPT's
follow-up questions, in the family of the conversation's first turn, after that family's first turns. They add
in-domain prompts (code and math first turns run out at ~3,500) and two-turn chats like MT-Bench's.
"""

import argparse
import json
import random
import re
from pathlib import Path

import numpy as np

from hf_diffspec.prompts import chat_prompt, eval_prompt_texts, iter_sharegpt
from hf_diffspec.trainers.data import classify_domain

# a programming language other than Python named in the prompt (Python is what HumanEval measures)
OTHER_CODE = re.compile(
    r"\b(rust|golang|javascript|typescript|node\.?js|react|java|kotlin|swift|c\+\+|c#|php|ruby|sql|mysql|postgres\w*|"
    r"bash|shell|powershell|haskell|scala|perl|lua|dart|flutter|vue|angular|html|css|solidity|matlab|vba|terraform|"
    r"dockerfile|kubernetes)\b", re.IGNORECASE)
PYTHON = re.compile(r"\bpython\b|\bpandas\b|\bdjango\b|\bflask\b|\bnumpy\b|\bpytorch\b", re.IGNORECASE)
ENGLISH = set("the and is of to in that it for you with this on are be i what how can".split())
# frequent short words of Latin-script languages; a prompt in one of them uses its words far more than English ones
STOPWORDS = {
    "fr": set("le les des est une pour avec dans que qui sur pas vous nous je il elle et du au ce cette".split()),
    "de": set("der die das und ist nicht ein eine ich sie mit für auf den dem zu wie sich auch es".split()),
    "es": set("el los las que es una por con para del como pero más está y en lo se muy".split()),
    "it": set("il che di è un una per con non sono del della gli come anche questo".split()),
    "pt": set("os que é um uma para com não do da em se como mais você são".split()),
    "nl": set("het een en van is dat niet op te voor met zijn ik je wat".split()),
}


def natural_language(text: str) -> str | None:
    """'zh/ja/ko', 'ru' or a Latin-script language code when the text is not English, else None (a heuristic)."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return None
    if sum(ord(ch) >= 0x2E80 for ch in letters) > 0.3 * len(letters):
        return "zh/ja/ko"
    if sum(0x400 <= ord(ch) < 0x500 for ch in letters) > 0.3 * len(letters):
        return "ru"
    words = re.findall(r"[^\W\d_]+", text.lower())
    english = sum(w in ENGLISH for w in words)
    scores = {lang: sum(w in stop for w in words) for lang, stop in STOPWORDS.items()}
    lang, score = max(scores.items(), key=lambda kv: kv[1])
    return lang if score >= 4 and score > 2 * english else None


def family(prompt: str) -> str:
    if natural_language(prompt):
        return "language"
    domain = classify_domain(prompt)
    if domain == "code" and OTHER_CODE.search(prompt) and not PYTHON.search(prompt):
        return "code-other"
    return domain


def candidate_prompts(exclude: set[str], min_chars: int = 24, max_chars: int = 4000) -> dict[str, list[dict]]:
    """Family -> prompts: the first human turn of each ShareGPT record, and for other languages every human turn."""
    by_family: dict[str, list[dict]] = {}
    seen: set[str] = set()
    for record in iter_sharegpt():
        turns = record.get("conversations") or []
        humans = [(i, (t.get("value") or "").strip()) for i, t in enumerate(turns) if t.get("from") == "human"]
        for rank, (i, text) in enumerate(humans):
            if not min_chars <= len(text) <= max_chars or text in exclude or text in seen:
                continue
            kind = family(text)
            if rank > 0 and kind != "language":
                continue
            seen.add(text)
            by_family.setdefault(kind, []).append({"id": f"sharegpt/{record.get('id')}/turn{i}", "prompt": text,
                                                   "domain": kind})
    return by_family


def mixed_order(by_family: dict[str, list[dict]], weights: dict[str, float], num: int, seed: int,
                after: dict[str, list[dict]] | None = None) -> list[dict]:
    """`num` prompts, interleaved so that every prefix holds the families in the shares of `weights` (a family that
    runs out gives what it has and the others fill in). The i-th prompt of a family sorts at (i + 0.5) / share,
    whatever `num` is, so the list for a larger `num` starts with the list for a smaller one: the list can grow
    without reordering what was already answered. `after`: per family, prompts that follow its shuffled ones in
    their given order (they move no prompt of `by_family`)."""
    rng = random.Random(seed)
    total = sum(weights.values())
    keyed = []
    for name, weight in weights.items():
        pool = by_family.get(name, [])
        pool = rng.sample(pool, len(pool)) + (after or {}).get(name, [])
        keyed += [((i + 0.5) * total / weight, name, p) for i, p in enumerate(pool)]
    keyed.sort(key=lambda item: (item[0], item[1]))
    return [p for _, _, p in keyed[:num]]


def answered(data_dir) -> dict[str, list[int]]:
    """Record id -> the target's answer (its tokens, with the closing EOS if it ended) for every sequence of a data
    folder."""
    answers = {}
    for sidecar in sorted(Path(data_dir).glob("shard-*.json")):
        arrays = np.load(sidecar.with_suffix(".npz"))
        tokens, offsets, prompt_lengths = arrays["tokens"], arrays["offsets"], arrays["prompt_lengths"]
        for i, record_id in enumerate(json.loads(sidecar.read_text())["ids"]):
            answers[record_id] = tokens[offsets[i] + prompt_lengths[i] : offsets[i + 1]].tolist()
    return answers


def follow_ups(answers: dict[str, list[int]], conversations: dict[str, list[dict]], families: dict[str, str],
               tokenizer, max_prompt_tokens: int, min_chars: int = 24, max_chars: int = 4000) -> dict[str, list[dict]]:
    """Family -> the next user turn of every answered conversation turn (ids `sharegpt/RID/turnK` for a first turn,
    `sharegpt/RID/turnK>M` for turn M after K, and so on), the assistant's turns being the target's own answers;
    in the order of `families` (the first turns' ids, in list order), shallower turns first. A prompt longer than
    `max_prompt_tokens` through the chat template is left out (what follows it must fit a training window)."""
    by_family: dict[str, list[tuple]] = {}
    order = {record_id: i for i, record_id in enumerate(families)}
    eos = tokenizer.eos_token_id
    for record_id in answers:
        source, rid, chain = record_id.split("/", 2)
        turns = [int(t) for t in chain.removeprefix("turn").split(">")]
        root = f"{source}/{rid}/turn{turns[0]}"
        conversation = conversations.get(rid)
        if root not in families or conversation is None:
            continue
        later = [i for i, t in enumerate(conversation) if i > turns[-1] and t.get("from") == "human"]
        if not later or not min_chars <= len((conversation[later[0]].get("value") or "").strip()) <= max_chars:
            continue
        messages = []
        for depth, turn in enumerate(turns):
            answer = answers.get(f"{root}>{'>'.join(map(str, turns[1 : depth + 1]))}" if depth else root)
            if answer is None:
                break
            answer = answer[:-1] if answer and answer[-1] == eos else answer
            messages += [{"role": "user", "content": conversation[turn]["value"].strip()},
                         {"role": "assistant", "content": tokenizer.decode(answer)}]
        else:
            messages.append({"role": "user", "content": conversation[later[0]]["value"].strip()})
            if len(chat_prompt(tokenizer, messages, tokenize=True)) <= max_prompt_tokens:
                family = families[root]
                by_family.setdefault(family, []).append(
                    (len(turns), order[root], {"id": f"{record_id}>{later[0]}", "messages": messages,
                                               "domain": family}))
    return {family: [p for *_, p in sorted(items, key=lambda item: item[:2])] for family, items in by_family.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default="code=0.25,code-other=0.15,math=0.15,chat=0.35,language=0.10",
                        help="family=share, comma-separated")
    parser.add_argument("--exclude-data", nargs="*", default=[],
                        help="data directories whose ShareGPT records are left out (already regenerated)")
    parser.add_argument("--follow-ups", nargs="*", default=[], metavar="DIR",
                        help="data folders of answered turns: add the next user turn of each conversation")
    parser.add_argument("--max-follow-up-tokens", type=int, default=384,
                        help="longest follow-up prompt, chat template included (a training window is 512)")
    args = parser.parse_args()
    weights = {k: float(v) for k, v in (item.split("=") for item in args.weights.split(","))}
    excluded_records = set()
    for directory in args.exclude_data:
        for sidecar in Path(directory).glob("shard-*.json"):
            excluded_records.update(json.loads(sidecar.read_text())["ids"])
    by_family = candidate_prompts(eval_prompt_texts())
    for name in by_family:  # a record already regenerated (id sharegpt/ID) is left out whatever its turn
        by_family[name] = [p for p in by_family[name] if p["id"].rsplit("/", 1)[0] not in excluded_records]
    after = {}
    if args.follow_ups:
        from hf_diffspec import load_target

        _, tokenizer = load_target("smollm2-135m-instruct")
        first_turns = {p["id"]: p["domain"] for p in mixed_order(by_family, weights, 10**9, args.seed)}
        conversations = {record.get("id"): record.get("conversations") or [] for record in iter_sharegpt()}
        answers = {}
        for directory in args.follow_ups:
            answers.update(answered(directory))
        after = follow_ups(answers, conversations, first_turns, tokenizer, args.max_follow_up_tokens)
    prompts = mixed_order(by_family, weights, args.num, args.seed, after)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    counts = {name: sum(p["domain"] == name for p in prompts) for name in weights}
    available = {name: len(by_family.get(name, [])) for name in weights}
    more = {name: len(after.get(name, [])) for name in weights}
    print(f"{len(prompts)} prompts -> {args.out}: {counts} (available {available}, follow-ups {more})")


if __name__ == "__main__":
    main()
