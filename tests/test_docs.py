"""The docs say what the code does: the CLI reference against the click definitions, links."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from kvforge.runners.manifest import SCHEMA_VERSION
from kvforge.toolchain.cli import main  # the whole group, the build commands registered

ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = ROOT / "docs" / "cli.md"
_OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def _sections(text: str) -> dict[str, str]:
    """Markdown `## heading` -> the text up to the next such heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def _documented_options(section: str) -> set[str]:
    """Option names in the first cell of the section's table rows."""
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `-"):
            names.update(_OPTION.findall(line.split("|")[1]))
    return names


def _option_names(params: list[click.Parameter]) -> set[str]:
    return {name for p in params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts}


def test_every_command_has_a_section() -> None:
    sections = _sections(CLI_DOC.read_text())
    assert {f"`kvforge {name}`" for name in main.commands} <= set(sections)
    documented = {title for title in sections if title.startswith("`kvforge ")}
    assert documented == {f"`kvforge {name}`" for name in main.commands}, "a documented command does not exist"


@pytest.mark.parametrize("name", sorted(main.commands))
def test_command_options_match_the_reference(name: str) -> None:
    command = main.commands[name]
    section = _sections(CLI_DOC.read_text())[f"`kvforge {name}`"]
    assert _documented_options(section) == _option_names(command.params)
    usage = section.split("```")[1]
    for argument in (p for p in command.params if isinstance(p, click.Argument)):
        assert argument.human_readable_name.upper() in usage, f"{name}: argument {argument.name} not in the usage line"


def test_global_options_match_the_reference() -> None:
    section = _sections(CLI_DOC.read_text())["Global options"]
    assert _documented_options(section) == _option_names(main.params)


def test_option_help_matches_click_choices() -> None:
    """The defaults stated in the reference are the defaults click applies."""
    build = {p.name: p for p in main.commands["build"].params}
    inspect = {p.name: p for p in main.commands["inspect"].params}
    text = CLI_DOC.read_text()
    assert f"default {build['decode_steps'].default})" in text
    assert f"(default {inspect['batch'].default})" in text


@pytest.mark.parametrize(
    "doc", sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
)
def test_relative_links_resolve(doc: str) -> None:
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{doc}: link to {target} does not resolve"


# The static parts of the error messages docs/troubleshooting.md quotes: each must still be
# raised somewhere in toolchain/ or runners/, so the page cannot drift from the code.
QUOTED_MESSAGES = [
    "transformers has no such model_type",
    "supported weight dtypes: ",
    "token ids (added tokens included; token ",
    "rows ({CONFIG} vocab_size); ",
    "use the tokenizer that belongs to these weights",
    "kvforge needs a fast tokenizer file; save one with ",
    "sha256 does not match {MANIFEST}; the file was modified, rebuild the artifact",
    "files differ from the checkpoint ",
    "compiled model does not match the eager model: ",
    "greedy tokens diverge at step ",
    "first diverging output ",
    "int4 costs too much accuracy on this model: build with --weights int8",
    "is not supported (expected one of ",
    " where decisive, ",
    "more than --device-memory ",
    "rebuild the artifact with this kvforge version",
    "missing; the artifact is incomplete, rebuild it with `kvforge build`",
    "exceeds the model's context of ",
    "similar): pass --context N, the most positions (prompt plus new tokens) the artifact will serve",
    "`kvforge build CHECKPOINT -o OUT` (or, for a target without the logits_to_keep input, --logits all)",
    "is not one kvforge imports (",
    "this is a kvforge artifact, not a checkpoint: ",
    "so it will not replace this: choose another -o",
]


@pytest.mark.parametrize("fragment", QUOTED_MESSAGES)
def test_troubleshooting_quotes_real_messages(fragment: str) -> None:
    source = "\n".join(p.read_text() for d in ("toolchain", "runners") for p in sorted((ROOT / d).glob("*.py")))
    assert fragment in source, f"no raise site says {fragment!r} any more; update docs/troubleshooting.md"
    rendered = fragment.format(CONFIG="config.json", MANIFEST="manifest.json", SCHEMA_VERSION=SCHEMA_VERSION)
    assert rendered in (ROOT / "docs" / "troubleshooting.md").read_text()


def test_the_family_lists_in_the_docs_are_the_suites() -> None:
    from tests.tiny import FAMILIES  # the families the suite builds and compares with transformers

    guide = (ROOT / "docs" / "getting-started.md").read_text()
    listing = guide.split("The `model_type`s the test suite builds")[1].split(". The hybrids")[0]
    assert re.findall(r"`([a-z0-9_]+)`", listing) == list(FAMILIES)
    readme = (ROOT / "README.md").read_text()
    paragraph = readme.split("Architectures: ")[1].split("\n\n")[0]
    count = re.search(r"(\d+) families are built", paragraph)
    assert count is not None and int(count.group(1)) == len(FAMILIES)
    assert set(FAMILIES) <= set(re.findall(r"[a-z0-9_]+", paragraph))
