"""Logprobs on the real engine (the session's small engine: float64 CPU, buckets 1 and 2, no
prefill programs): what GenerationStream returns with `logprobs` / `prompt_logprobs` is the
target's log_softmax at each token's position as an independent eager reference computes it
over prompt + output, and asking for them changes no token (runtime/logprobs.py)."""
import pytest
import torch

from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime import logprobs as lp
from dspark_compile.runtime.logprobs import MAX_LOGPROBS

# fp32 payload of fp64 logits: |log p| < 20 here, so rounding is below 20 * 2^-24 ~ 1.2e-6
TOL = 2e-6


def _run(eng, requests):
    """requests: [(prompt, params, add kwargs)] in one stream -> per request (tokens,
    logprobs, prompt_logprobs, events)."""
    s = eng.open_stream()
    ids = [s.add(p, sp, **kw) for p, sp, kw in requests]
    out = {i: [[], [], None, 0] for i in ids}
    try:
        while s.has_work:
            for e in s.step():
                o = out[e.request]
                o[0] += e.tokens
                o[3] += 1
                if e.logprobs is not None:
                    assert len(e.logprobs) == len(e.tokens), "one entry per committed token"
                    o[1] += e.logprobs
                if e.prompt_logprobs is not None:
                    assert o[2] is None, "prompt logprobs come once"
                    o[2] = e.prompt_logprobs
    finally:
        s.close()
    return [out[i] for i in ids]


def _reference_logsoftmax(eng, ref_model, seq):
    """log_softmax of the reference target's logits at every position of `seq`, computed by
    the model loaded from the checkpoint (not the engine's) in a state of its own."""
    from dspark_compile.models.batch import Batch
    from dspark_compile.models.state import allocate_state
    state = allocate_state(ref_model.cfg, eng.cache, ref_model.prec, torch.device("cpu"))
    b = Batch.make(torch.tensor([0]), torch.arange(len(seq))[None], torch.tensor(seq)[None],
                   eng.cache.max_rows, ref_model.cfg.vocab_size)
    with torch.no_grad():
        logits, _ = ref_model(b, state)
    return torch.log_softmax(logits[0].double(), -1)


def _check_entry(entry, token, ls_row, k):
    """One token's entry: its logprob is log_softmax's, the top k are the k largest,
    sorted, each with log_softmax's value, and hold the token when it ranks within k."""
    got, top = entry
    assert abs(got - ls_row[token].item()) < TOL
    assert len(top) == k
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    for i, v in top:
        assert abs(v - ls_row[i].item()) < TOL
    if k:
        assert abs(vals[0] - ls_row.max().item()) < TOL
        if ls_row[token] > ls_row.topk(k).values[-1] + 1e-9:
            assert token in [i for i, _ in top]


def test_logprobs_are_the_targets_log_softmax_and_change_no_token(small_loaded, ref_model):
    """Greedy and seeded sampled requests, with and without logprobs in one batch (so a
    logprobs step carries rows that did not ask): the tokens are generate()'s, and every
    committed token's logprob (accepted drafts, the bonus, the prefill's first) is the
    reference target's log_softmax at its position, within fp32 rounding."""
    eng = small_loaded
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(temperature=0, max_new_tokens=9),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=7),
              SamplingParams(temperature=0, max_new_tokens=6)]
    want = eng.generate(prompts, params).tokens
    got = _run(eng, [(prompts[0], params[0], {"logprobs": 3}),
                     (prompts[1], params[1], {"logprobs": MAX_LOGPROBS}),
                     (prompts[2], params[2], {})])
    assert [g[0] for g in got] == want, "asking for logprobs changed the tokens"
    assert got[2][1] == [], "a request that did not ask gets no logprobs"
    for (prompt, tokens, k), (_, lps, _, _) in zip(
            [(prompts[0], want[0], 3), (prompts[1], want[1], MAX_LOGPROBS)], got):
        assert len(lps) == len(tokens)
        ls = _reference_logsoftmax(eng, ref_model, prompt + tokens)
        for t, (tok, entry) in enumerate(zip(tokens, lps)):
            _check_entry(entry, tok, ls[len(prompt) - 1 + t], k)


def test_prompt_logprobs_alone_commit_nothing(small_loaded, ref_model):
    """prompt_logprobs with decode=False (echo with max_tokens 0): one event, finished, no
    token; the first prompt token's entry is None, each other's the reference's."""
    eng = small_loaded
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 200, 17]
    (tokens, lps, plp, events), = _run(eng, [(prompt, SamplingParams(max_new_tokens=1),
                                              {"prompt_logprobs": 2, "decode": False})])
    assert tokens == [] and lps == [] and events == 1
    assert len(plp) == len(prompt) and plp[0] is None
    ls = _reference_logsoftmax(eng, ref_model, prompt)
    for p in range(1, len(prompt)):
        _check_entry(plp[p], prompt[p], ls[p - 1], 2)


def test_bad_logprobs_are_refused_by_name(small_loaded):
    eng = small_loaded
    with eng.open_stream() as s:
        for kw, name in (({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
                         ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"decode": False}, "prompt_logprobs")):
            with pytest.raises(ValueError, match=name):
                s.add([1, 2, 3], SamplingParams(max_new_tokens=2), **kw)


def test_an_engine_without_the_variant_refuses_logprobs_by_name(small_engine):
    """Loaded with logprobs=False (as an engine whose steps have nothing to derive from):
    a logprobs request is a ValueError naming logprobs and the rebuild; others run."""
    from dspark_compile.runtime.engine import Engine
    eng = Engine.load(small_engine.path, device="cpu", logprobs=False, target=False)
    assert eng.logprob_programs == {}
    with eng.open_stream() as s:
        with pytest.raises(ValueError, match="logprobs: .*rebuild"):
            s.add([1, 2, 3], SamplingParams(max_new_tokens=2), logprobs=1)


def test_the_payload_is_log_softmax_of_raw_logits():
    """payload() (what the derived programs compute, op for op): raw log_softmax, before
    any temperature, at fp32 of the logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 50, generator=g, dtype=torch.float64) * 4
    tokens = torch.tensor([[4, 7, -1], [0, 49, 3]])
    p = lp.payload(logits, tokens, 5)
    c, v, ids = lp.decode(lp.to_bits(p), 3, 5)
    ls = torch.log_softmax(logits, -1)
    for b in range(2):
        for j in range(3):
            assert abs(c[b][j] - ls[b, j, max(int(tokens[b, j]), 0)].item()) < 1e-6
            assert ids[b][j] == ls[b, j].topk(5).indices.tolist()


# ---- through the server: the openai client's requests ------------------------------------------

@pytest.fixture(scope="module")
def served(small_loaded, tmp_path_factory):
    from serve.serve_helpers import train_tokenizer
    from dspark_compile.serve.server import Server
    from dspark_compile.serve.text import Tokenizer
    tok = Tokenizer.load(train_tokenizer(tmp_path_factory.mktemp("lp_tok") / "tokenizer.json"))
    with Server(small_loaded, model_name="tiny", max_queue=8, tokenizer=tok) as srv:
        yield srv.start(), tok


def _client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_logprobs_streamed_and_not_are_the_engines(served, small_loaded, ref_model):
    """A greedy and a seeded sampled request with `logprobs` 2: the same tokens as without;
    token_logprobs the reference's; top_logprobs holds the top 2 and the token itself; the
    stream's chunks concatenate to the non-streamed logprobs."""
    url, _ = served
    c = _client(url)
    prompt = [5, 6, 7, 8, 9]
    for kw in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 11}):
        plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, **kw)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=2, **kw)
        ids = got.choices[0].model_extra["token_ids"]
        assert ids == plain.choices[0].model_extra["token_ids"], "logprobs changed the tokens"
        lp = got.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        ls = _reference_logsoftmax(small_loaded, ref_model, prompt + ids)
        for t, (tok, v, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
            assert abs(v - ls[len(prompt) - 1 + t, tok].item()) < TOL
            # keyed by string: ids that decode alike (bytes of one character) share a key
            assert lp.tokens[t] in top and 1 <= len(top) <= 3
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                           logprobs=2, stream=True, **kw))
        streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs
                                                 if ch.choices[0].logprobs else [])]
        assert streamed == lp.token_logprobs
        offsets = [x for ch in chunks for x in (ch.choices[0].logprobs.text_offset
                                                if ch.choices[0].logprobs else [])]
        assert offsets == lp.text_offset


def test_loglikelihood_as_an_evaluation_harness_asks(served, small_loaded, ref_model):
    """Prompt token ids, echo, logprobs 1, max_tokens 0 (and 1): the prompt's text, one
    logprob per prompt token, the first None, the others the reference's; max_tokens 1 adds
    the one generated token after them."""
    url, tok = served
    c = _client(url)
    prompt = tok.encode("The quick brown fox jumps")
    ls = _reference_logsoftmax(small_loaded, ref_model, prompt)
    r = c.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                             temperature=0)
    ch = r.choices[0]
    assert ch.text == tok.decode(prompt) and ch.finish_reason == "length"
    assert ch.model_extra["token_ids"] == [] and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - ls[p - 1, prompt[p]].item()) < TOL
    one = c.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                               temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:len(prompt)] == lp.token_logprobs
    assert len(one.choices[0].logprobs.token_logprobs) == len(prompt) + 1
    assert one.choices[0].text.startswith(ch.text)


def test_chat_logprobs_with_the_openai_client(served):
    """logprobs: true, top_logprobs 2: one content entry per completion token, each with 2
    top entries sorted, the first the (greedy) token itself, its bytes its token's UTF-8;
    the stream's entries are the same."""
    url, _ = served
    c = _client(url)
    msgs = [{"role": "user", "content": "servers stream text"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                  logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    streamed = [e for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
