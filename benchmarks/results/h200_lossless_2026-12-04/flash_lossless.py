"""Device-only: greedy speculative == target-only, 64 random prompts x 64 tokens, per bucket."""
import random, sys, time, json
from dspark_compile.runtime.engine import Engine
from dspark_compile.runtime.lossless import compare_outputs
from dspark_compile.models.generate import SamplingParams
eng = Engine.load(sys.argv[1], device="cuda", target=True)
rng = random.Random(7)
V = eng.cfg.vocab_size
prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(64)]
params = [SamplingParams(max_new_tokens=64) for _ in prompts]
res = {}
for b in eng.buckets:
    t = time.perf_counter(); bad = []; acc = 0; steps = 0
    for s in range(0, 64, b):
        g, sp = prompts[s:s + b], params[s:s + b]
        spec = eng.generate(g, sp)
        plain = eng.generate(g, sp, speculative=False).tokens
        acc += sum(spec.accepted_at)
        r = compare_outputs(plain, spec.tokens)
        if not r.ok:
            bad.append(f"requests {s}..{s+len(g)-1}: {r.line()}")
    res[b] = {"groups_diverged": bad, "accepted": acc, "seconds": round(time.perf_counter() - t, 1)}
    print(f"bucket {b}: {'ok' if not bad else 'DIVERGED'} accepted drafts {acc} in {res[b]['seconds']}s", flush=True)
    for x in bad: print("  ", x, flush=True)
print(json.dumps(res, indent=1))
