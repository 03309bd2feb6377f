"""The README stays what a newcomer reads in a few minutes: at most 300 lines, no dated measurement without the
command that reproduces it beside it (dated logs belong in docs/results.md and docs/training-log.md), and its test
command the one `.ci/run` runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bmeasured on\b", re.IGNORECASE)
COMMAND = re.compile(r"^(hf-diffspec|python3?|bash)\b")


def blocks(text: str) -> list[list[str]]:
    """Paragraphs, tables and list items run together as they render: lines between blank lines, a fenced code block
    whole (with its fences)."""
    found, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if not fenced and current:
                found.append(current)
                current = []
            current.append(line)
            fenced = not fenced
            if not fenced:
                found.append(current)
                current = []
        elif fenced or line.strip():
            current.append(line)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def has_command(block: list[str]) -> bool:
    """A command a reader can run: a line of a fenced block, or a code span, starting with hf-diffspec, python or
    bash."""
    if block[0].startswith("```"):
        return any(COMMAND.match(line.strip()) for line in block[1:-1])
    return any(COMMAND.match(span.strip()) for span in re.findall(r"`([^`]+)`", " ".join(block)))


def dated_without_command(text: str) -> list[str]:
    """The first line of every block holding a date or "measured on" with no command in it nor in a code block right
    after it."""
    found = [*blocks(text), ["(end)"]]
    return [block[0] for block, after in zip(found, found[1:]) if DATED.search("\n".join(block))
            and not has_command(block) and not (after[0].startswith("```") and has_command(after))]


def test_the_check_finds_a_dated_figure_without_its_command():
    text = ("Intro.\n\nOn 2026-11-30 it reached 1.3x.\n\nNext paragraph, `hf-diffspec demo`.\n\n"
            "Measured on a quiet machine: 2.0x with\n\n```bash\nhf-diffspec bench --methods ar,dflash\n```\n\n"
            "| run | speed |\n|---|---|\n| 2026-12-01 | 1.1x (`python examples/benchmarks/x.py`) |\n")
    assert dated_without_command(text) == ["On 2026-11-30 it reached 1.3x."]
    assert dated_without_command("Plain text, `hf-diffspec demo`, no date.\n") == []


def test_readme_is_short_and_every_dated_figure_has_its_command():
    text = (ROOT / "README.md").read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move detail to docs/"
    missing = dated_without_command(text)
    assert not missing, ("dated measurements without a command beside them (give the command, or move them to "
                         "docs/results.md or docs/training-log.md):\n" + "\n".join(missing))


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text().splitlines()
