"""DeepSeek-V4's chat format (models/chat_format.py): the prompts of the public description's
examples, byte for byte; the reasoning / content split at `</think>` however the text is cut;
a checkpoint's Jinja template rendered in the sandbox."""
import json
from pathlib import Path

import pytest

from dspark_compile.models.chat_format import (BOS, EOS, REASONING_EFFORT_MAX, ChatError,
                                              ChatFormat, ReasoningSplit, render_deepseek_v4,
                                              split_reasoning)


def test_thinking_prompt_is_the_descriptions_quick_start():
    # encoding/README.md, Quick Start: a system and a user message in thinking mode
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"}]
    assert render_deepseek_v4(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?"
        "<｜Assistant｜><think>")


def test_chat_mode_multi_turn_is_the_descriptions_basic_chat():
    # encoding/README.md, Basic chat: every assistant header closes the thinking block at once
    msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    assert render_deepseek_v4(msgs, thinking=False) == (
        "<｜begin▁of▁sentence｜>SYS<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>U2<｜Assistant｜></think>")


def test_earlier_turns_reasoning_is_dropped_in_thinking_mode():
    # the multi-turn example: the first answer's reasoning is not in the prompt, its header
    # is the chat-mode one, and only the new turn opens <think>
    msgs = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello! I am DeepSeek.",
             "reasoning_content": "thinking..."},
            {"role": "user", "content": "1+1=?"}]
    out = render_deepseek_v4(msgs, thinking=True)
    assert out == ("<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am "
                   "DeepSeek.<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>")
    assert "thinking..." not in out


def test_max_effort_puts_its_instruction_first_in_thinking_mode_only():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_deepseek_v4(msgs, True, "max") == (
        BOS + REASONING_EFFORT_MAX + "S<｜User｜>U<｜Assistant｜><think>")
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum")
    assert render_deepseek_v4(msgs, True, "high") == BOS + "S<｜User｜>U<｜Assistant｜><think>"
    assert render_deepseek_v4(msgs, False, "max") == BOS + "S<｜User｜>U<｜Assistant｜></think>"


def test_consecutive_user_messages_get_one_header():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_deepseek_v4(msgs, False) == BOS + "<｜User｜>a<｜User｜>b<｜Assistant｜></think>"


@pytest.mark.parametrize("msgs,param", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"},
      {"role": "user", "content": "b"}], "messages[1].role"),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
     "messages[0].role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     "messages[1].role"),
])
def test_conversations_the_format_cannot_render_name_the_message(msgs, param):
    with pytest.raises(ChatError) as e:
        render_deepseek_v4(msgs, True)
    assert e.value.param == param


TEXT = "Let me see: 2+2 is 4 </thi nope </think>The answer is 4."


def test_reasoning_split_is_the_same_at_every_cut():
    want = ("Let me see: 2+2 is 4 </thi nope ", "The answer is 4.")
    assert split_reasoning(TEXT, True) == want
    for a in range(len(TEXT) + 1):
        for b in range(a, len(TEXT) + 1):
            s = ReasoningSplit(True)
            parts = [s.add(TEXT[:a]), s.add(TEXT[a:b]), s.add(TEXT[b:]), s.finish()]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, (a, b)


def test_reasoning_split_one_character_at_a_time_never_leaks_a_partial_marker():
    s = ReasoningSplit(True)
    seen_reasoning = ""
    for ch in TEXT:
        r, c = s.add(ch)
        seen_reasoning += r
        assert "</" not in seen_reasoning[len("Let me see: 2+2 is 4 </thi nope "):]
    assert seen_reasoning == "Let me see: 2+2 is 4 </thi nope "


def test_chat_mode_is_all_content_and_unclosed_reasoning_is_all_reasoning():
    assert split_reasoning(TEXT, False) == (None, TEXT)
    assert split_reasoning("still thinking </th", True) == ("still thinking </th", "")


def _engine(tmp_path, cfg):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ChatFormat.of_engine(tmp_path)


def test_a_checkpoints_template_is_used_instead(tmp_path):
    tpl = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}[a]{% if thinking %}<think>{% endif %}{% endif %}")
    fmt = _engine(tmp_path, {"chat_template": tpl, "bos_token": {"content": "<s>"},
                             "eos_token": "</s>"})
    assert (fmt.bos, fmt.eos) == ("<s>", "</s>")
    assert fmt.render([{"role": "user", "content": "hi"}], True, "high") == "<s>[user]hi[a]<think>"


def test_without_a_template_the_deepseek_format_uses_the_configs_tokens(tmp_path):
    fmt = _engine(tmp_path, {"bos_token": "<B>", "eos_token": "<E>"})
    assert fmt.template_source is None
    out = fmt.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}], False, None)
    assert out == "<B><｜User｜>a<｜Assistant｜></think>b<E><｜User｜>c<｜Assistant｜></think>"
    assert ChatFormat.of_engine(tmp_path / "none").bos == BOS and EOS


def test_a_template_cannot_reach_outside_the_sandbox(tmp_path):
    fmt = _engine(tmp_path, {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ChatError, match="unsafe|failed"):
        fmt.render([{"role": "user", "content": "x"}], False, None)
    fmt = _engine(tmp_path, {"chat_template": "{% set _ = messages.append(1) %}x"})
    with pytest.raises(ChatError, match="unsafe"):
        fmt.render([{"role": "user", "content": "x"}], False, None)


def test_a_template_that_does_not_compile_is_refused_at_load_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template.*does not compile"):
        _engine(tmp_path, {"chat_template": "{% for %}"})


def test_the_templates_raise_exception_is_a_refusal_of_the_messages(tmp_path):
    fmt = _engine(tmp_path, {"chat_template": "{{ raise_exception('no system here') }}"})
    with pytest.raises(ChatError, match="no system here"):
        fmt.render([{"role": "user", "content": "x"}], False, None)


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "1"},
     {"role": "assistant", "content": "A"}, {"role": "user", "content": "2"},
     {"role": "user", "content": "3"}, {"role": "assistant", "content": "B"},
     {"role": "user", "content": "{{ not a template }}"}],
]


@pytest.mark.parametrize("msgs", CONVERSATIONS)
@pytest.mark.parametrize("thinking,effort", [(False, None), (True, "high"), (True, "max")])
def test_the_jinja_template_renders_what_the_function_does(msgs, thinking, effort):
    from dspark_compile.models.chat_format import (DEEPSEEK_V4_TEMPLATE, compile_template,
                                                  render_template)
    t = compile_template(DEEPSEEK_V4_TEMPLATE, "test")
    for bos, eos in ((BOS, EOS), ("<|bos|>", "<|eos|>")):
        assert render_template(t, msgs, bos, eos, thinking, effort) == \
            render_deepseek_v4(msgs, thinking, effort, bos, eos)


def test_the_engines_tokenizer_config_carries_the_template_and_the_tokenizers_bos_eos(tmp_path):
    from dspark_compile.models.chat_format import DEEPSEEK_V4_TEMPLATE, tokenizer_config
    from dspark_compile.serve.text import Tokenizer
    tok = Tokenizer.load(Path(__file__).resolve().parents[2] / "dspark_compile" / "factory" / "data" / "tiny-trained" / "tokenizer.json")
    cfg = json.loads(tokenizer_config(tmp_path, tok, 0, 1))
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|bos|>", "<|eos|>")
    assert cfg["chat_template"] == DEEPSEEK_V4_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    fmt = ChatFormat.of_engine(tmp_path, tok, 0, 1)
    assert fmt.template_source is None and fmt.bos == "<|bos|>"   # the function renders it
    own = {"chat_template": "{{ messages[0]['content'] }}", "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(own))
    assert json.loads(tokenizer_config(tmp_path, tok, 0, 1)) == own    # a checkpoint's own


def test_hugging_face_reads_the_engine_as_a_tokenizer_directory(tmp_path):
    """What a tool given `--tokenizer ENGINE` does: AutoTokenizer over tokenizer.json and the
    tokenizer_config.json the build writes, its apply_chat_template equal to the server's."""
    transformers = pytest.importorskip("transformers")
    from dspark_compile.models.chat_format import tokenizer_config
    from dspark_compile.serve.text import Tokenizer
    src = Path(__file__).resolve().parents[2] / "dspark_compile" / "factory" / "data" / "tiny-trained"
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(tokenizer_config(src, tok, 0, 1))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = CONVERSATIONS[2]
    for thinking, effort in ((False, None), (True, "max")):
        got = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                     thinking=thinking, reasoning_effort=effort)
        assert got == render_deepseek_v4(msgs, thinking, effort, "<|bos|>", "<|eos|>")
    assert (hf.bos_token, hf.eos_token) == ("<|bos|>", "<|eos|>")


def test_the_build_reads_bos_eos_from_the_tokenizer_json_without_the_library(tmp_path):
    from dspark_compile.models.chat_format import tokenizer_config
    src = Path(__file__).resolve().parents[2] / "dspark_compile" / "factory" / "data" / "tiny-trained"
    spec = json.loads((src / "tokenizer.json").read_text())
    cfg = json.loads(tokenizer_config(tmp_path, spec, 0, 1, 160))
    assert (cfg["bos_token"], cfg["eos_token"], cfg["model_max_length"]) == \
        ("<|bos|>", "<|eos|>", 160)
    cfg = json.loads(tokenizer_config(tmp_path, {"model": {"vocab": {"a": 0}}}, 5, None))
    assert (cfg["bos_token"], cfg["eos_token"]) == (BOS, EOS)    # ids it lacks: the format's
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert json.loads(tokenizer_config(tmp_path))["chat_template"] == \
        "{{ messages[0]['content'] }}"                           # a checkpoint's own file


def test_an_engines_tokenizer_config_outside_the_file_table_is_refused(tmp_path):
    """serve renders the engine's chat template: a tokenizer_config.json dropped into an engine
    (not written and checksummed by the build) is not the engine's."""
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.paths import check_engine
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ 1 }}"}')
    with pytest.raises(ArtifactError, match="'tokenizer_config.json' is not in the manifest's "
                                            "file table"):
        check_engine(tmp_path, {"files": {}})


def test_a_template_that_writes_without_bound_is_stopped(tmp_path):
    fmt = _engine(tmp_path, {"chat_template": "{% for i in range(99999) %}{% for j in "
                                              "range(99999) %}xxxxxxxxxx{% endfor %}"
                                              "{% endfor %}"})
    with pytest.raises(ChatError, match="wrote more than"):
        fmt.render([{"role": "user", "content": "x"}], False, None)
