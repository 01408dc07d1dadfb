"""Summary of run mla26b (docs/device-runs/mla26.md): CHECK, TIME, SPEEDUP lines from $OUT/r."""

import csv, os, statistics as st
d = os.environ["OUT"] + "/r/"
def rows(n):
    try: return list(csv.DictReader(open(d + n)))
    except OSError: return []
for r in rows("mla_check.csv"):
    print("CHECK", r["config"].split()[0], r["heads"], r["batch"], r["T"], r["mask"], r["splits"], "err %.4f" % float(r["rel_err"]), "ok" if r["ok"] == "True" else "FAIL", r["error"][:80])
t = [r for r in rows("mla_time.csv") if r["status"] == "ok"]
for k in ("gluon", "gluon_tma"):
    for h in ("8", "64"):
        v = [float(r["vs_flashmla"]) for r in t if r["kernel"] == k and r["heads"] == h and r.get("vs_flashmla")]
        f = [float(r["tflops"]) for r in t if r["kernel"] == k and r["heads"] == h]
        if v: print("TIME", k, h, len(v), "x_fm median %.2f min %.2f max %.2f TF/s median %.0f max %.0f" % (st.median(v), min(v), max(v), st.median(f), max(f)))
by = {(r["kernel"], r["heads"], r["batch"], r["budget"], r["context"]): float(r["us_p50"]) for r in t}
sp = [by[("gluon",) + s[1:]] / u for s, u in by.items() if s[0] == "gluon_tma" and ("gluon",) + s[1:] in by]
if sp: print("SPEEDUP tma over gluon: n=%d median %.2f min %.2f max %.2f" % (len(sp), st.median(sp), min(sp), max(sp)))
print("SKIPPED/ERR", sum(r["status"] != "ok" for r in rows("mla_time.csv")))
