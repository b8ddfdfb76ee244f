import jspec, os
for n in sorted(os.listdir("/tmp/sweep_hf/unsup")):
    d = f"/tmp/sweep_hf/unsup/{n}"
    if not os.path.isdir(d): continue
    try:
        jspec.load_hf(d, dtype="float32", backend="xla"); print(n, "LOADED?!")
    except Exception as e:
        print(f"{n}: {type(e).__module__}.{type(e).__name__}: {e}")
