"""The episode viewer as static files: ``index.html`` (every episode, filterable by family, outcome, source, split
and policy version, with per-family success over versions drawn by matplotlib) and one page per episode that
steps through its turns, the screenshot beside what the policy wrote. No server and nothing fetched: the pages open
from a shared file system (sshfs, Jupyter), screenshots by relative path into the run's image store.

The index's filters live in the page's address (``index.html#family=files_move&outcome=fail``), so a filtered view
can be linked to and reloaded.
"""

from __future__ import annotations

import collections
import html
import os
from pathlib import Path

from launch.episodes.collect import SET_ASIDE, EpisodeSet, version_of

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1d1f24; }
table { border-collapse: collapse; } td, th { padding: 3px 8px; border-bottom: 1px solid #e3e5ea; text-align: left; }
th { background: #f3f4f7; } tr.ok td.outcome { color: #17803d; } tr.no td.outcome { color: #b42318; }
form { margin: 1em 0; display: flex; gap: 1em; flex-wrap: wrap; } label { font-weight: 600; }
pre { white-space: pre-wrap; background: #f6f7f9; padding: .6em; margin: .3em 0; max-height: 26em; overflow: auto; }
.turn { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 1.2em; border-top: 2px solid #d0d4dc;
        padding: .8em 0; } .turn img { max-width: 100%; border: 1px solid #ccd; }
.meta td:first-child { font-weight: 600; color: #555; } .missing { color: #b42318; } .err { color: #b42318; }
nav a { margin-right: 1.2em; } .note { color: #555; }
"""

FILTER_SCRIPT = """
const form = document.getElementById('filters');
const rows = Array.from(document.querySelectorAll('#episodes tbody tr'));
function apply() {
  const f = Object.fromEntries(new FormData(form).entries());
  const vmin = f.vmin === '' ? -Infinity : Number(f.vmin), vmax = f.vmax === '' ? Infinity : Number(f.vmax);
  let shown = 0;
  for (const r of rows) {
    const d = r.dataset, v = d.version === '' ? NaN : Number(d.version);
    const ok = (!f.family || d.family === f.family) && (!f.outcome || d.outcome === f.outcome) &&
      (!f.source || d.source === f.source) && (!f.split || d.split === f.split) &&
      (f.vmin === '' && f.vmax === '' || (v >= vmin && v <= vmax));
    r.hidden = !ok; shown += ok;
  }
  document.getElementById('shown').textContent = shown + ' of ' + rows.length + ' episodes shown';
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(f)) if (v !== '') p.set(k, v);
  history.replaceState(null, '', '#' + p.toString());
}
for (const [k, v] of new URLSearchParams(location.hash.slice(1))) if (form.elements[k]) form.elements[k].value = v;
form.addEventListener('input', apply); form.addEventListener('change', apply); apply();
"""


IMG_ERROR = ("this.replaceWith(Object.assign(document.createElement(\"p\"), {className: \"missing\", "
             "textContent: \"this screenshot could not be shown (unreadable or not an image)\"}))")
"""a file in the store that is no image shows a sentence, not a broken icon"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _page(title: str, body: str, script: str = "") -> str:
    return (f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{body}\n" + (f"<script>{script}</script>" if script else "")
            + "</body></html>\n")


def _select(name: str, values: list[str]) -> str:
    opts = "".join(f"<option value='{_e(v)}'>{_e(v)}</option>" for v in values)
    return f"<label>{name} <select name={name}><option value=''>all</option>{opts}</select></label>"


def page_name(ep: dict) -> str:
    return "ep-" + "".join(c for c in ep["id"] if c.isalnum() or c in "-_") + ".html"


def plot_success(eps: EpisodeSet, out: Path) -> bool:
    """Per-family success over policy versions (training episodes; evaluations as one dashed line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for ep in eps.episodes:
        v = version_of(ep)
        if v is None or ep.get("source") == SET_ASIDE:  # chosen for crashing the learner: no sample of success
            continue
        key = "evaluation (all families)" if ep.get("source") == "eval" else str(ep.get("family", "?"))
        series[key][int(v)].append(int(bool(ep.get("success"))))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=100)
    for name, by_v in sorted(series.items()):
        xs = sorted(by_v)
        ys = [sum(by_v[x]) / len(by_v[x]) for x in xs]
        style = {"linestyle": "--", "color": "black"} if name.startswith("evaluation") else {}
        ax.plot(xs, ys, marker="o", markersize=3, label=name, **style)
    ax.set_xlabel("policy version")
    ax.set_ylabel("success rate of the recorded episodes")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _index(eps: EpisodeSet, plotted: bool) -> str:
    fams = sorted({str(e.get("family", "")) for e in eps.episodes})
    splits = sorted({str(e.get("split", "")) for e in eps.episodes})
    rows = []
    for ep in eps.episodes:
        v = version_of(ep)
        ok = bool(ep.get("success"))
        rows.append(
            f"<tr class={'ok' if ok else 'no'} data-family='{_e(ep.get('family', ''))}' "
            f"data-outcome={'success' if ok else 'fail'} data-source='{_e(ep.get('source', ''))}' "
            f"data-split='{_e(ep.get('split', ''))}' data-version='{'' if v is None else v}'>"
            f"<td><a href='{page_name(ep)}'>{_e(ep['id'])}</a></td><td>{_e(ep.get('source', ''))}</td>"
            f"<td>{_e(ep.get('family', ''))}</td><td>{_e(ep.get('split', ''))}</td><td>{'' if v is None else v}</td>"
            f"<td class=outcome>{'success' if ok else 'fail'}</td><td>{_e(ep.get('reward', ''))}</td>"
            f"<td>{_e(ep.get('steps', ''))}</td><td>{_e(ep.get('finish', ''))}</td><td>{_e(ep.get('fate', ''))}</td>"
            f"<td>{_e(str(ep.get('instruction', ''))[:90])}</td></tr>")
    skipped = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(eps.skipped.items()))
    body = (f"<h1>Episodes of {_e(eps.run.name)}</h1>"
            f"<p class=note>{len(eps.episodes)} recorded episodes from {_e(eps.run)}"
            + (f"; lines skipped: {_e(skipped)}" if skipped else "") + "</p>"
            + ("<img src='success.png' alt='per-family success over policy versions'>" if plotted else "")
            + "<form id=filters>" + _select("family", fams) + _select("outcome", ["success", "fail"])
            + _select("source", ["train", "eval"]) + _select("split", splits)
            + "<label>versions <input name=vmin type=number size=5> to <input name=vmax type=number size=5></label>"
            + "</form><p id=shown></p>"
            "<table id=episodes><thead><tr><th>episode</th><th>source</th><th>family</th><th>split</th><th>version</th>"
            "<th>outcome</th><th>reward</th><th>turns</th><th>ended by</th><th>what the learner did</th>"
            "<th>instruction</th></tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>")
    return _page(f"episodes: {eps.run.name}", body, FILTER_SCRIPT)


def _episode(eps: EpisodeSet, i: int, out: Path) -> str:
    ep = eps.episodes[i]
    adv = ep.get("advantages", {})
    nav = "<nav><a href='index.html'>all episodes</a>"
    if i > 0:
        nav += f"<a href='{page_name(eps.episodes[i - 1])}'>previous</a>"
    if i + 1 < len(eps.episodes):
        nav += f"<a href='{page_name(eps.episodes[i + 1])}'>next</a>"
    nav += "</nav>"
    version = f"{version_of(ep)}" + (f" (lag {ep['lag']} when trained)" if "lag" in ep else "")
    meta = [("task", ep.get("task")), ("family", ep.get("family")), ("split", ep.get("split")),
            ("instruction", ep.get("instruction")), ("policy version", version),
            ("outcome", f"{'success' if ep.get('success') else 'fail'} (reward {ep.get('reward')}), ended by "
                        f"{ep.get('finish')}, {ep.get('steps')} turns, {ep.get('format_errors', 0)} format errors")]
    if ep.get("source") != "eval":
        meta += [("group", f"{ep.get('group')} (episode {ep.get('index', 0) + 1}): rewards {ep.get('group_rewards')}"),
                 ("what the learner did", ep.get("fate"))]
    body = [nav, f"<h1>Episode {_e(ep['id'])} <small>({_e(ep.get('source', ''))})</small></h1>",
            "<table class=meta>" + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in meta) + "</table>"]
    for t_i, t in enumerate(ep.get("turns", [])):
        shots = []
        for dig in t.get("images", []):
            path = eps.images.path(dig)
            if path.exists():
                shots.append(f"<img src='{_e(os.path.relpath(path, out))}' alt='screenshot {_e(dig[:12])}' "
                             f"onload='this.dataset.shown=this.naturalWidth' onerror='{IMG_ERROR}'>")
            else:
                shots.append(f"<p class=missing>screenshot {_e(dig[:16])}… is missing from the image store</p>")
        obs = f"<pre class=obs>{_e(t.get('obs', ''))}</pre>"
        left = "".join(shots) + (f"<details><summary>what the policy read</summary>{obs}</details>" if shots else obs)
        lp = t.get("logprob")
        facts = (f"{_e(t.get('tokens', '?'))} tokens, mean log-prob {_e(lp if lp is not None else '-')}, "
                 f"version {_e(t.get('version', '?'))}" + (f", advantage {adv[t_i]:+.3f}" if t_i in adv else ""))
        result = _e(t.get("result", "")) + (" <span class=err>[format error]</span>" if t.get("format_error") else "")
        body.append(f"<section class=turn id=turn-{t_i + 1}><div><h3>Turn {t_i + 1}: the screen</h3>{left}</div>"
                    f"<div><h3>The policy wrote</h3><pre class=action>{_e(t.get('text', ''))}</pre>"
                    f"<p class=note>{facts}</p><h3>The desktop answered</h3><p class=result>{result}</p></div>"
                    "</section>")
    body.append(nav)
    return _page(f"episode {ep['id']}", "\n".join(body))


def write_site(eps: EpisodeSet, out: str | Path) -> Path:
    """Write the viewer into ``out`` (created); returns the index page."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plotted = plot_success(eps, out / "success.png")
    for i, ep in enumerate(eps.episodes):
        (out / page_name(ep)).write_text(_episode(eps, i, out), encoding="utf-8")
    index = out / "index.html"
    index.write_text(_index(eps, plotted), encoding="utf-8")
    return index
