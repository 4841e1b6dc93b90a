import json,sys,statistics
rows=[json.loads(l) for l in open(sys.argv[1])]
keys=["load.wake","store_prepared","store_prepared.to_copy","store_prepared.issue","store","store.issue","load","load.to_copy","load.issue","load_retrieve","load_retrieve.issue","lookup_rt"]
for ch in sorted({r["chunks"] for r in rows}):
    print(f"-- {ch} chunks (p50 us per pass; old / new)")
    for k in keys:
        o=[round(r["p50_us"][k]) for r in rows if r["chunks"]==ch and r["tree"]=="old"]
        n=[round(r["p50_us"][k]) for r in rows if r["chunks"]==ch and r["tree"]=="new"]
        print(f"{k:24s} old {o} med {statistics.median(o):.0f} | new {n} med {statistics.median(n):.0f}")
