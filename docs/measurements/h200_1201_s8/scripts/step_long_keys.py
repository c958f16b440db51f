"""Session 8, call 3: tools/bench_step.py with the native engine's runner.long_keys forced (argv[1]: an int, 0 =
# As run. Its last line never printed: bench_step ends in os._exit(0), so the `finally` did not run.
never split for long contexts), by patching DecodeRunner in this process (the bench's single worker runs here)."""
import runpy, sys
sys.path[:0] = ["tools", "."]
import hybridrl.engines.fused.runner as r
value = int(sys.argv[1])
made = []
orig = r.DecodeRunner.__init__
def init(self, *a, **k):
    orig(self, *a, **k)
    self.long_keys = value
    made.append(self)
r.DecodeRunner.__init__ = init
sys.argv = ["tools/bench_step.py", *sys.argv[2:]]
try:
    runpy.run_path("tools/bench_step.py", run_name="__main__")
finally:
    print(f"PATCHED_RUNNERS={len(made)} long_keys={value}", flush=True)
