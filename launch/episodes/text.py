"""One recorded episode as plain text, for a terminal (``computerrl episodes RUN --text ID``)."""

from __future__ import annotations

import textwrap

from common.images import ImageStore
from launch.episodes.collect import version_of


def _block(text: str, width: int = 100) -> str:
    lines = str(text).splitlines() or [""]
    return "\n".join(textwrap.indent(line, "    ") for line in lines)[:20000]


def screenshot_note(images: ImageStore, digest: str) -> str:
    return f"screenshot {digest[:16]}… " + ("(in the image store)" if images.path(digest).exists()
                                                else "(missing from the image store)")


def render_text(ep: dict, images: ImageStore) -> str:
    adv = ep.get("advantages", {})
    out = [
        f"episode {ep['id']}  ({ep.get('source', '?')}, policy version {version_of(ep)}"
        + (f", lag {ep['lag']} when trained)" if "lag" in ep else ")"),
        f"task         {ep.get('task', '?')}   family {ep.get('family', '?')}   split {ep.get('split', '?')}",
        f"instruction  {ep.get('instruction', '')}",
        f"outcome      reward {ep.get('reward')}   success {ep.get('success')}   ended by {ep.get('finish', '?')}   "
        f"{ep.get('steps', len(ep.get('turns', [])))} turns, {ep.get('format_errors', 0)} format errors",
    ]
    if ep.get("source") != "eval":
        out.append(f"group        {ep.get('group', '?')}   rewards {ep.get('group_rewards', [])}   -> {ep.get('fate')}")
    for i, t in enumerate(ep.get("turns", [])):
        out.append(f"\n--- turn {i + 1} ---")
        for dig in t.get("images", []):
            out.append(screenshot_note(images, dig))
        out.append("observation:")
        out.append(_block(t.get("obs", "")))
        lp = t.get("logprob")
        head = (f"policy: {t.get('tokens', '?')} tokens, mean log-prob {lp if lp is not None else '-'}, "
                f"version {t.get('version', '?')}")
        if i in adv:
            head += f", advantage {adv[i]:+.3f}"
        out.append(head)
        out.append(_block(t.get("text", "")))
        out.append("desktop: " + str(t.get("result", "")) + ("   [format error]" if t.get("format_error") else ""))
    return "\n".join(out) + "\n"
