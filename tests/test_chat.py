"""Chat (issue #20): templates rendered as llama-cpp-python renders them, prompts tokenized and
end-of-generation tokens found as llama.cpp does, and the ``chat`` / ``generate --chat`` commands.

The templates below are written for these tests in the styles of four families (ChatML as Qwen
uses it, Llama 3, Gemma, Phi-3) plus one that uses the less common Jinja features (``tojson``,
``{% break %}``, ``{% generation %}``). llama.cpp and llama-cpp-python run in one child process
(``sys.executable``), which keeps their libggml apart from ggml-python's, loaded by other test
modules. The end-to-end tests run the CLI in-process on a tiny random model whose logits are
scripted (``Model.eval`` wrapped): with greedy sampling it answers "!!!" then ``<|im_end|>``.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import lazyggml as lg
from lazyggml.chat import ChatTemplate, ChatTemplateError, chat_template, tokenize_chat
from lazyggml.cli import main
from lazyggml.models.runner import Model
from lazyggml.testing import make_tiny_model

CHATML = """\
{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

Year: {{ strftime_now("%Y") }}
{{ system }}<|eot_id|>
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = """\
{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set first_user_prefix = "" %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {% endif %}
    {% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
<start_of_turn>{{ role }}
{{ (first_user_prefix if loop.first else "") ~ message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""

PHI3 = """\
{% for message in messages %}
    {% if message['role'] in ['system', 'user', 'assistant'] %}
<|{{ message['role'] }}|>
{{ message['content'] }}<|end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% else %}
{{ eos_token }}
{% endif %}
"""

EXTRAS = """\
{% for message in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% generation %}{{ message | tojson }}{% endgeneration %}

{% endfor %}
{{ undefined_name }}{{ add_generation_prompt }} {{ tools is none }} {{ undefined_name is defined }}
"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "phi3": PHI3, "extras": EXTRAS}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": " Answer in one word. "},
               {"role": "user", "content": "What is 2 + 2?\n"},
               {"role": "assistant", "content": "Four."},
               {"role": "user", "content": "And naïve <b>&'\"</b>, 世界?"}],
}

# the tokens the templates above write, as control tokens of the test vocabulary; with llama.cpp's
# other end-of-generation tokens (FIM tokens of Qwen's vocabulary, <|eom_id|>, Kimi's [EOT])
CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                 "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|eom_id|>", "[EOT]")
# gpt-oss's vocabulary: with <|return|> and <|call|> present, <|end|> ends a message, not the generation
HARMONY_SPECIALS = ("<|start|>", "<|return|>", "<|call|>", "<|end|>")
# Phi-3's (llama.cpp refuses a vocabulary named Phi-3 without <unk>, <s>, </s> and <|endoftext|>)
PHI3_SPECIALS = ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"    # the tiny gpt2 vocabulary's
LLAMA2 = "{% for m in messages %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"

CHILD = r"""
import json, sys
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
job = json.load(open(sys.argv[1]))
out = {"renders": [], "tokens": [], "eog": {}}
for r in job["renders"]:
    fmt = Jinja2ChatFormatter(template=r["template"], eos_token=r["eos"], bos_token=r["bos"],
                              add_generation_prompt=r["agp"])
    try:
        out["renders"].append({"prompt": fmt(messages=r["messages"]).prompt})
    except Exception as e:
        out["renders"].append({"error": str(e)})
models = {}
for path, text, add_bos in job["tokenize"]:
    llm = models.get(path) or models.setdefault(path, llama_cpp.Llama(path, vocab_only=True, verbose=False))
    out["tokens"].append(llm.tokenize(text.encode(), add_bos=add_bos, special=True))
for path in job["eog"]:
    llm = models.get(path) or models.setdefault(path, llama_cpp.Llama(path, vocab_only=True, verbose=False))
    vocab = llm._model.vocab
    out["eog"][path] = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
json.dump(out, open(sys.argv[2], "w"))
"""


def _render_cases():
    """(template name, conversation name, add_generation_prompt) for every combination."""
    return [(t, c, agp) for t in TEMPLATES for c in CONVERSATIONS for agp in (True, False)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return {
        "chat": str(make_tiny_model(d / "chat.gguf", arch="qwen2", n_vocab=320, chat_template=CHATML,
                                    extra_special=CHAT_SPECIALS)),
        "harmony": str(make_tiny_model(d / "harmony.gguf", arch="qwen2", n_vocab=320,
                                       extra_special=HARMONY_SPECIALS)),
        "spm": str(make_tiny_model(d / "spm.gguf", arch="llama", vocab="llama", chat_template=LLAMA2)),
        "plain": str(make_tiny_model(d / "plain.gguf", arch="qwen2", n_vocab=320)),
        "phi3": str(_renamed(make_tiny_model(d / "phi3src.gguf", arch="qwen2", n_vocab=320,
                                             extra_special=PHI3_SPECIALS), d / "phi3.gguf", "lazyggml tiny phi-3")),
        "dir": d,
    }


def _renamed(src, dst, name):
    """A copy of a tiny model file whose ``general.name`` is ``name`` (as long as the old one: the
    bytes are replaced in place). llama.cpp treats a vocabulary named Phi-3 specially."""
    old = b"lazyggml tiny qwen2"
    assert len(name) == len(old)
    dst.write_bytes(src.read_bytes().replace(old, name.encode(), 1))
    return dst


def _tokenizer(path):
    return lg.Tokenizer(lg.read_gguf(path).metadata, path)


def _prompts(files):
    """(path, rendered text) of every template and conversation on the vocabulary that has its tokens,
    and the SPM model's own template, whose text starts with BOS."""
    out = []
    for t, c, agp in _render_cases():
        out.append((files["chat"], ChatTemplate(TEMPLATES[t], bos_token=BOS, eos_token=EOS).render(
            CONVERSATIONS[c], add_generation_prompt=agp)))
    for c in CONVERSATIONS:   # Phi-3's vocabulary drops the whitespace after special tokens
        out.append((files["phi3"], ChatTemplate(PHI3, bos_token=BOS, eos_token=EOS).render(CONVERSATIONS[c])))
    spm = files["spm"]
    out.append((spm, chat_template(lg.read_gguf(spm).metadata, _tokenizer(spm), spm).render(CONVERSATIONS["user"])))
    return out


@pytest.fixture(scope="module")
def oracle(files):
    """What llama-cpp-python renders, and llama.cpp tokenizes and counts as end of generation."""
    renders = [dict(template=TEMPLATES[t], bos=BOS, eos=EOS, agp=agp, messages=CONVERSATIONS[c])
               for t, c, agp in _render_cases()]
    renders.append(dict(template=GEMMA, bos=BOS, eos=EOS, agp=True, messages=CONVERSATIONS["system"][1:3][::-1]))
    # llama.cpp's rule for a chat prompt: BOS as the vocabulary asks, unless the text starts with it
    tokenize = []
    for path, text in _prompts(files):
        bos = _tokenizer(path).tokens[_tokenizer(path).bos_id]
        tokenize.append((path, text, not text.startswith(bos)))
    job = {"renders": renders, "tokenize": tokenize, "eog": [files[k] for k in ("chat", "harmony", "spm", "phi3")]}
    job_file, result_file = files["dir"] / "job.json", files["dir"] / "result.json"
    job_file.write_text(json.dumps(job))
    r = subprocess.run([sys.executable, "-c", CHILD, str(job_file), str(result_file)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"the llama.cpp child failed ({r.returncode}):\n{r.stderr[-6000:]}"
    return json.loads(result_file.read_text())


# -- rendering ----------------------------------------------------------------------------------------
def test_rendering_matches_llama_cpp_python(oracle):
    for (t, c, agp), want in zip(_render_cases(), oracle["renders"]):
        got = ChatTemplate(TEMPLATES[t], bos_token=BOS, eos_token=EOS).render(CONVERSATIONS[c],
                                                                             add_generation_prompt=agp)
        assert got == want["prompt"], (t, c, agp)
    # a sanity check that the cases differ where they should: the generation prompt is there or not
    chatml = ChatTemplate(CHATML).render(CONVERSATIONS["user"])
    assert chatml.endswith("<|im_start|>assistant\n") and chatml.startswith("<|im_start|>system\n")


def test_raise_exception_in_a_template_is_a_clear_error(oracle):
    """Gemma's template refuses a conversation that starts with the assistant, in both renderers."""
    messages = CONVERSATIONS["system"][1:3][::-1]
    assert "roles must alternate" in oracle["renders"][-1]["error"]
    with pytest.raises(ChatTemplateError, match="refused the conversation: Conversation roles must alternate"):
        ChatTemplate(GEMMA, where="gemma.gguf: tokenizer.chat_template").render(messages)


# -- tokens ----------------------------------------------------------------------------------------------
def test_prompt_tokens_match_llama_cpp(files, oracle):
    prompts = _prompts(files)
    for (path, text), want in zip(prompts, oracle["tokens"]):
        assert tokenize_chat(_tokenizer(path), text) == want, text
    # the SPM model's template writes BOS itself: one BOS, not two
    spm_ids = oracle["tokens"][-1]
    assert spm_ids[0] == 1 and spm_ids[1] != 1
    # Phi-3: "<|user|>\nHello!" is <|user|> "Hello!" (no newline token)
    phi3, user = _tokenizer(files["phi3"]), oracle["tokens"][-3]
    assert user[1:3] == [phi3.tokens.index("<|user|>"), phi3.tokenize("Hello!", add_special=False)[0]]


def test_end_of_generation_tokens_match_llama_cpp(files, oracle):
    for name in ("chat", "harmony", "spm", "phi3"):
        tok = _tokenizer(files[name])
        assert sorted(tok.eog_ids) == oracle["eog"][files[name]], name
    tok = _tokenizer(files["chat"])
    for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", EOS):
        assert tok.is_eog(tok.tokens.index(text)), text
    assert not tok.is_eog(tok.tokens.index("<|im_start|>"))
    harmony = _tokenizer(files["harmony"])
    assert not harmony.is_eog(harmony.tokens.index("<|end|>"))


# -- errors -----------------------------------------------------------------------------------------------
def test_template_errors_name_their_source(files):
    tok = _tokenizer(files["chat"])
    meta = dict(lg.read_gguf(files["chat"]).metadata)
    meta["tokenizer.chat_template"] = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ChatTemplateError, match=r"^model\.gguf: tokenizer\.chat_template: line 1: "):
        chat_template(meta, tok, "model.gguf")
    del meta["tokenizer.chat_template"]
    with pytest.raises(ChatTemplateError, match=r"model\.gguf: the file has no chat template .*--chat-template"):
        chat_template(meta, tok, "model.gguf")
    # an undefined name renders empty (as in llama-cpp-python and transformers); using one is an error
    with pytest.raises(ChatTemplateError, match=r"--chat-template: rendering failed: UndefinedError"):
        chat_template(meta, tok, "model.gguf", override="{{ nothing.here }}").render([])
    # the sandbox: a template cannot reach Python's internals
    with pytest.raises(ChatTemplateError, match="rendering failed: SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render([])
    # a file given to --chat-template is read and named
    f = files["dir"] / "broken.jinja"
    f.write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match=rf"^--chat-template {f}: line 1"):
        chat_template(meta, tok, "model.gguf", override=str(f))
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        chat_template(meta, tok, "model.gguf", override=str(f) + ".missing")


def test_cli_template_errors_are_one_line(files, monkeypatch, capsys):
    assert main(["generate", files["plain"], "--chat", "-p", "hi", "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazyggml: error: ")
    assert "has no chat template (tokenizer.chat_template)" in err and "--chat-template" in err
    assert main(["generate", files["chat"], "--system", "Be brief."]) == 1
    assert capsys.readouterr().err == "lazyggml: error: --system and --chat-template need --chat\n"
    # chat says what it loaded on stderr; the error is the last line
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(["chat", files["chat"], "--chat-template", "{{ raise_exception('no chatting') }}"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "lazyggml: error: --chat-template: the template refused the conversation: no chatting"


# -- the commands, end to end --------------------------------------------------------------------------
class Scripted:
    """``Model.eval`` wrapped: the real computation, but the last row of logits says "!" for
    ``n_bang`` tokens in a row after a prompt, then ``<|im_end|>``; ``calls`` records what was evaluated."""

    def __init__(self, monkeypatch, tok, n_bang=3):
        self.calls, self.run = [], 0
        self.bang = tok.tokenize("!", add_special=False)[0]
        self.end = tok.tokens.index("<|im_end|>")
        real = Model.eval

        def scripted(model, tokens, logits_all=True):
            out = real(model, tokens, logits_all).copy()
            tokens = [int(t) for t in tokens]
            self.calls.append(tokens)
            self.run = self.run + 1 if tokens == [self.bang] else 0
            out[-1] = 0.0
            out[-1, self.bang if self.run < n_bang else self.end] = 1.0
            return out
        monkeypatch.setattr(Model, "eval", scripted)


def _ids(path, messages):
    tok = _tokenizer(path)
    return tokenize_chat(tok, chat_template(lg.read_gguf(path).metadata, tok, path).render(messages))


def test_generate_chat_evaluates_the_rendered_prompt_and_stops_at_end_of_turn(files, monkeypatch, capsys):
    path = files["chat"]
    script = Scripted(monkeypatch, _tokenizer(path))
    assert main(["generate", path, "--chat", "-p", "Hello!", "--system", "Be brief.", "--temp", "0",
                 "-n", "20"]) == 0
    out = capsys.readouterr().out
    want = _ids(path, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}])
    assert script.calls[0] == [0] and script.calls[1] == want   # the warm-up step, then the prompt
    assert "\n!!!\n" in out and "Hello" not in out              # the answer alone, not the prompt
    assert f"prefill: {len(want)} tokens" in out and "decode: " in out and "(3 tokens)" in out


def test_chat_keeps_the_conversation_and_evaluates_only_new_tokens(files, monkeypatch, capsys):
    path = files["chat"]
    script = Scripted(monkeypatch, _tokenizer(path))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\n\nHow are you?\n"))
    assert main(["chat", path, "--temp", "0", "-n", "20"]) == 0
    cap = capsys.readouterr()
    assert cap.out == "!!!\n!!!\n"                               # the empty line is skipped
    u1, u2 = {"role": "user", "content": "Hello!"}, {"role": "user", "content": "How are you?"}
    ids1 = _ids(path, [u1])
    ids2 = _ids(path, [u1, {"role": "assistant", "content": "!!!"}, u2])
    cached = len(ids1) + 3                                       # the prompt and the three "!"
    assert ids2[:cached] == ids1 + [script.bang] * 3             # the premise: the cache is a prefix
    prompts = [c for c in script.calls[1:] if c != [script.bang]]
    assert prompts == [ids1, ids2[cached:]]
    assert cap.err.count("stop: eog") == 2 and f"prefill: {len(ids2) - cached} new tokens" in cap.err


def test_chat_ends_cleanly_when_the_context_is_full(files, monkeypatch, capsys):
    path = files["chat"]
    u1 = {"role": "user", "content": "Hello!"}
    ids2 = _ids(path, [u1, {"role": "assistant", "content": "!!!"}, u1])
    Scripted(monkeypatch, _tokenizer(path))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\nHello!\n"))
    assert main(["chat", path, "--temp", "0", "-c", str(len(ids2) - 1)]) == 0
    cap = capsys.readouterr()
    assert cap.out == "!!!\n" and "more than the context" in cap.err
    # an answer that runs into the end of the context is cut, and the chat ends
    Scripted(monkeypatch, _tokenizer(path), n_bang=1000)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\nHello!\n"))
    n_ctx = len(_ids(path, [u1])) + 5
    assert main(["chat", path, "--temp", "0", "-c", str(n_ctx)]) == 0
    cap = capsys.readouterr()
    assert cap.out == "!" * 6 + "\n" and "the answer was cut" in cap.err and "stop: context" in cap.err
