"""The artifact's tokenizer: tokenizer.json plus the fields of tokenizer_config.json we use.

Only the ``tokenizers`` library is needed (no transformers at run time), so the few
settings transformers keeps in tokenizer_config.json (chat template, bos/eos/pad
tokens) are read here directly, in the shapes transformers writes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from kvforge.runners.chat import render_chat
from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.errors import ArtifactError, GenerationError
from kvforge.runners.manifest import read_json_object

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers >= 4.47 may save the template beside the config instead of inside it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass
class TokenizerBundle:
    """A fast tokenizer with the chat template and special tokens that go with it."""

    tokenizer: tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    pad_token_id: int | None

    @classmethod
    def load(cls, directory: Path) -> TokenizerBundle:
        """Read tokenizer.json (required) and tokenizer_config.json (optional)."""
        directory = Path(directory)
        tokenizer = _read_tokenizer(directory / TOKENIZER_FILE)
        config = read_json_object(directory / TOKENIZER_CONFIG_FILE, missing_ok=True)
        config_path = directory / TOKENIZER_CONFIG_FILE
        pad_token = _token_field(config, "pad_token", config_path)
        return cls(
            tokenizer=tokenizer,
            chat_template=_chat_template(directory, config),
            bos_token=_token_field(config, "bos_token", config_path),
            eos_token=_token_field(config, "eos_token", config_path),
            pad_token_id=tokenizer.token_to_id(pad_token) if pad_token is not None else None,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens are those tokenizer.json's post-processor adds.

        Pass ``add_special_tokens=False`` for text rendered by a chat template, which
        already holds them.
        """
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, as the whole sequence decodes (not streamed)."""
        checked = [int(i) for i in ids]
        negative = [i for i in checked if i < 0]
        if negative:
            raise GenerationError(f"token ids must be >= 0, got {negative[0]}")
        return self.tokenizer.decode(checked, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template into prompt text."""
        if self.chat_template is None:
            raise GenerationError(
                "the artifact's tokenizer has no chat template (no chat_template in "
                f"{TOKENIZER_CONFIG_FILE} or {CHAT_TEMPLATE_FILE}); pass a plain prompt instead "
                "of chat messages, or add a template to the checkpoint and rebuild"
            )
        return render_chat(
            self.chat_template,
            messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            add_generation_prompt=add_generation_prompt,
        )

    def detokenizer(self, stop: Sequence[str] = (), context_ids: Sequence[int] = ()) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one sequence generated after ``context_ids``."""
        return StreamingDetokenizer(self.tokenizer, stop=stop, context_ids=context_ids)


def _read_tokenizer(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ArtifactError(
            f"{path}: missing; the artifact needs the model's {TOKENIZER_FILE} (a fast "
            "tokenizer): rebuild it from a checkpoint that has one"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception for malformed files
        raise ArtifactError(f"{path}: not a valid tokenizers file ({error}); rebuild the artifact") from error


def _token_field(config: Mapping[str, Any], field: str, path: Path) -> str | None:
    """A special token as transformers saves it: a string, or an AddedToken dict."""
    value = config.get(field)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ArtifactError(
        f"{path}: {field} must be a string or an object with a string 'content', got {value!r}; "
        "fix the file or rebuild the artifact"
    )


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja first, as transformers prefers it."""
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ArtifactError(f"{jinja_path}: not UTF-8 text ({error}); rebuild the artifact") from error
    return _config_chat_template(config, directory / TOKENIZER_CONFIG_FILE)


def _config_chat_template(config: Mapping[str, Any], path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(_is_named_template(item) for item in value):
        raise ArtifactError(
            f"{path}: chat_template must be a string or a list of "
            "{'name': ..., 'template': ...} objects; fix the file or rebuild the artifact"
        )
    templates = {item["name"]: item["template"] for item in value}
    if "default" not in templates:
        logger.warning(
            "%s: chat_template has no 'default' entry (found %s); chat prompts are disabled",
            path,
            ", ".join(sorted(templates)) or "none",
        )
        return None
    return str(templates["default"])


def _is_named_template(item: object) -> bool:
    return isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
