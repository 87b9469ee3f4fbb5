"""Chat templates: exact rendering as transformers would produce, and a sandbox that holds."""

from __future__ import annotations

import json
import re
import time

import pytest

from kvforge.runners.chat import render_chat
from kvforge.runners.errors import GenerationError

# The ChatML template that Qwen2 and many others ship, written as they write it.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Llama-2-like template that relies on block trimming, bos/eos and raise_exception.
LLAMA_LIKE = """\
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system = none %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' }}{% if loop.first and system %}{{ '<<SYS>>' + system + '<</SYS>> ' }}{% endif %}{{ message['content'] | trim + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}
"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "日本語 🙂?"},
]


def test_chatml_renders_exactly() -> None:
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n日本語 🙂?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(CHATML, MESSAGES) == expected


def test_add_generation_prompt_toggles_the_assistant_header() -> None:
    with_prompt = render_chat(CHATML, MESSAGES[:2], add_generation_prompt=True)
    without = render_chat(CHATML, MESSAGES[:2], add_generation_prompt=False)
    assert without == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_and_special_tokens_like_transformers() -> None:
    rendered = render_chat(LLAMA_LIKE, MESSAGES, bos_token="<s>", eos_token="</s>")
    # trim_blocks + lstrip_blocks remove every line that holds only block tags, with its
    # indentation and newline; lines with an expression keep both (lstrip_blocks strips
    # before block tags only).
    indent = " " * 8
    assert rendered == (
        f"{indent}<s>[INST] <<SYS>>You are terse.<</SYS>> Hi there [/INST]\n"
        f"{indent} Hello. </s>\n"
        f"{indent}<s>[INST] 日本語 🙂? [/INST]\n"
    )


def test_raise_exception_message_surfaces() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(GenerationError, match="Conversation roles must alternate"):
        render_chat(LLAMA_LIKE, bad)


def test_raise_exception_is_a_generation_error_naming_the_template() -> None:
    with pytest.raises(GenerationError, match=r"^chat template rejected the messages: no tools$"):
        render_chat("{{ raise_exception('no tools') }}", [])


def test_messages_are_reachable_by_attribute_and_item() -> None:
    template = "{% for m in messages %}{{ m.role }}={{ m['content'] }};{% endfor %}"
    assert render_chat(template, MESSAGES[1:3]) == "user=Hi there;assistant=Hello.;"


def test_tojson_does_not_escape_html_or_non_ascii_and_takes_options() -> None:
    template = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}"
    message = {"role": "user", "content": "<b>é</b> & 'q'"}
    first, second = render_chat(template, [message]).split("|")
    assert first == '{"role": "user", "content": "<b>é</b> & \'q\'"}'
    assert second == json.dumps(message, ensure_ascii=False, indent=2, sort_keys=True)


def test_tools_and_documents_are_none_like_transformers() -> None:
    template = "{{ tools is none }} {{ documents is none }} {{ tools is defined }}"
    assert render_chat(template, []) == "True True True"


def test_namespace_loop_controls_and_generation_block() -> None:
    template = (
        "{% set ns = namespace(count=0) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.count = ns.count + 1 %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% if ns.count == 2 %}{% break %}{% endif %}"
        "{% endfor %}{{ ns.count }}"
    )
    assert render_chat(template, MESSAGES) == "[Hi there][Hello.]2"


def test_strftime_now_is_available() -> None:
    assert re.fullmatch(r"\d{4}", render_chat("{{ strftime_now('%Y') }}", []))


def test_messages_are_not_mutated_and_must_be_mappings() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(GenerationError, match="unsafe"):
        render_chat("{{ messages[0].update({'content': 'y'}) }}", messages)
    assert messages == [{"role": "user", "content": "x"}]
    with pytest.raises(GenerationError, match=r"messages\[1\] must be a mapping"):
        render_chat(CHATML, [{"role": "user", "content": "x"}, "hello"])  # type: ignore[list-item]
    with pytest.raises(GenerationError, match="messages must be a list"):
        render_chat(CHATML, "hello")  # type: ignore[arg-type]


# --- the sandbox --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{% set d = {} %}{{ d.update(a=1) }}",
        "{{ (1).__class__.__base__.__subclasses__() }}",
    ],
)
def test_unsafe_templates_raise_generation_error(template: str) -> None:
    with pytest.raises(GenerationError, match=r"^chat template attempted an unsafe operation"):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_underscore_attributes_are_not_rendered_even_when_silent() -> None:
    # The sandbox hides private attributes as undefined; nothing of the object leaks.
    template = (
        "[{{ ''.__class__ }}][{{ messages.__len__ }}][{{ raise_exception.__globals__ }}]"
        "[{{ self._TemplateReference__context }}]"
    )
    assert render_chat(template, []) == "[][][][]"


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }}",  # unclosed block
        "{{ messages[0] }",  # unclosed expression
        "{% frobnicate %}",  # unknown tag
    ],
)
def test_syntax_errors_name_the_chat_template(template: str) -> None:
    with pytest.raises(
        GenerationError, match=r"^chat template has a syntax error at line \d+: .*tokenizer_config\.json"
    ):
        render_chat(template, MESSAGES)


def test_runtime_errors_in_the_template_become_generation_errors() -> None:
    with pytest.raises(GenerationError, match=r"chat template failed while rendering: ZeroDivisionError"):
        render_chat("{{ 1 / 0 }}", [])
    with pytest.raises(GenerationError, match=r"^chat template failed"):
        render_chat("{{ messages[0]['content'] }}", [])


def test_output_over_the_limit_is_refused() -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "x" * 100}] * 5
    assert len(render_chat(template, messages, max_output_chars=500)) == 500
    with pytest.raises(GenerationError, match="exceeds max_output_chars=499"):
        render_chat(template, messages, max_output_chars=499)


def test_a_huge_loop_is_cut_off_by_the_output_limit() -> None:
    template = "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}"
    with pytest.raises(GenerationError, match="exceeds max_output_chars=1000"):
        render_chat(template, [], max_output_chars=1000)


@pytest.mark.parametrize(
    "template",
    ["{{ 'x' * 10**12 }}", "{{ [1] * 1000000000 }}", "{{ 1000000000 * 'ab' }}", "{{ 7 ** 1000000000 }}"],
)
def test_memory_bombs_are_refused_before_they_allocate(template: str) -> None:
    with pytest.raises(GenerationError, match="too large|repeats a value"):
        render_chat(template, [], max_output_chars=10_000)


def test_small_arithmetic_still_works() -> None:
    assert render_chat("{{ '-' * 3 }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 2.5 * 2 }}", []) == "---1024125.0"


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_bad_output_limit_is_refused(limit: object) -> None:
    with pytest.raises(GenerationError, match="max_output_chars"):
        render_chat(CHATML, MESSAGES, max_output_chars=limit)  # type: ignore[arg-type]


def test_template_must_be_a_string() -> None:
    with pytest.raises(GenerationError, match="chat template must be a string"):
        render_chat(None, MESSAGES)  # type: ignore[arg-type]


# --- the time limit -----------------------------------------------------------------------

SLOW_TEMPLATES = {
    # nested loops that output nothing: the output limit never fires
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # loops over a string: no call, no lookup, no output inside; only the loop hook sees them
    "loops over text": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    # exponential recursion through a macro, each level well within Python's recursion limit
    "branching macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "loop over messages": (
        "{% for a in range(100000) %}{% for m in messages %}{% for k in m %}{% endfor %}{% endfor %}{% endfor %}"
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
}


@pytest.mark.parametrize("name", sorted(SLOW_TEMPLATES))
def test_a_template_that_runs_too_long_without_output_is_stopped(name: str) -> None:
    start = time.monotonic()
    with pytest.raises(GenerationError, match=r"^chat template rendering ran past max_render_seconds=0\.2 .*fix or"):
        render_chat(SLOW_TEMPLATES[name], MESSAGES, max_render_seconds=0.2)
    assert time.monotonic() - start < 2.0


def test_the_deadline_is_per_render() -> None:
    with pytest.raises(GenerationError, match="max_render_seconds"):
        render_chat(SLOW_TEMPLATES["nested ranges"], [], max_render_seconds=0.05)
    assert render_chat(CHATML, MESSAGES[:1]) == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>assistant\n"
    time.sleep(0.1)  # a deadline left behind by the failed render would have passed by now
    quick = "{% for i in range(1000) %}{% endfor %}done"
    assert render_chat(quick, [], max_render_seconds=0.05) == "done"


def test_loops_keep_their_features_under_the_deadline_wrapper() -> None:
    template = (
        "{% for i in range(3) %}{{ loop.index }}/{{ loop.length }}{{ loop.cycle('a', 'b') }}"
        "{% if not loop.last %},{% endif %}{% endfor %}|"
        "{% for m in [] %}x{% else %}empty{% endfor %}|"
        "{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}|"
        "{% for m in messages recursive %}{{ m.role }}{% endfor %}|"
        "{% for m in messages if m.role == 'user' %}{{ loop.revindex }}{% endfor %}"
    )
    assert render_chat(template, MESSAGES) == "1/3a,2/3b,3/3a|empty|a=1|systemuserassistantuser|21"


@pytest.mark.parametrize("limit", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_bad_time_limit_is_refused(limit: object) -> None:
    with pytest.raises(GenerationError, match="max_render_seconds must be a finite number > 0"):
        render_chat(CHATML, MESSAGES, max_render_seconds=limit)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
        "{% set ns = namespace(_hidden=1) %}",
        "{% set ns = namespace({'__init__': 1}) %}",
    ],
)
def test_namespaces_refuse_underscore_names(template: str) -> None:
    with pytest.raises(GenerationError, match=r"^chat template attempted an unsafe operation"):
        render_chat(template, [])


def test_dict_global_builds_dicts_without_exposing_the_type() -> None:
    template = "{{ dict(a=1) | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }} [{{ dict.__class__ }}]"
    assert render_chat(template, []) == '{"a": 1} {"x": 0} []'


# --- parity with transformers, where it is installed ---------------------------------------

PARITY_TEMPLATES = {
    "chatml": CHATML,
    "llama_like": LLAMA_LIKE,
    "tojson_tools": (
        "{% if tools is not none %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m | tojson(indent=1) }}\n{% endfor %}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    ),
    "namespace_generation": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n{% endif %}"
        "{% endfor %}{{ ns.n }}"
    ),
}


@pytest.mark.parametrize("name", sorted(PARITY_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(name: str, add_generation_prompt: bool) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = PARITY_TEMPLATES[name]
    messages = MESSAGES
    (expected,), _ = chat_template_utils.render_jinja_template(
        conversations=[[dict(m) for m in messages]],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )
    ours = render_chat(
        template,
        messages,
        bos_token="<s>",
        eos_token="</s>",
        add_generation_prompt=add_generation_prompt,
    )
    assert ours == expected


def _words(messages: list[dict[str, str]]) -> int:
    """A prompt's length in this test's units: one per word of every message, one per message header."""
    return sum(1 + len(m["content"].split()) for m in messages)


def test_a_conversation_drops_its_oldest_turns_to_fit_and_keeps_the_system_message() -> None:
    from kvforge.runners.chat import Conversation

    talk = Conversation(_words, limit=12, system="be brief")  # the system message costs 3
    messages, dropped = talk.ask("one two")
    assert dropped == 0 and messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one two"},
    ]
    talk.answer("three four five")
    messages, dropped = talk.ask("six")  # 3 + 3 + 4 + 2 = 12: fits exactly
    assert dropped == 0 and len(messages) == 4
    talk.answer("seven eight")
    messages, dropped = talk.ask("nine ten")  # 12 + 3 + 3 = 18: the first turn goes, then 3 + 2 + 3 + 3 = 11
    assert dropped == 1
    assert [m["content"] for m in messages] == ["be brief", "six", "seven eight", "nine ten"]
    assert _words(messages) <= 12


def test_a_message_too_long_alone_is_refused_and_the_conversation_is_kept() -> None:
    from kvforge.runners.chat import Conversation

    talk = Conversation(_words, limit=8)
    talk.ask("a b")
    talk.answer("c")
    before = talk.messages()
    with pytest.raises(GenerationError, match="a prompt of 9 tokens, past the 8 this chat leaves"):
        talk.ask("w " * 8)
    assert talk.messages() == before
    talk.reset()
    assert talk.messages() == [] and talk.ask("d")[0] == [{"role": "user", "content": "d"}]
