"""tools/bench/RESULTS.md holds one "## <title>" section per benchmark; each bench rewrites only its own."""

from __future__ import annotations

import os
import re

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def replace_section(title: str, body: str, path: str = RESULTS) -> None:
    """Put ``## {title}`` followed by ``body`` in place of that section (appended when absent)."""
    section = f"## {title}\n\n{body.strip()}"
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    pattern = re.compile(rf"## {re.escape(title)}\n.*?(?=\n+## |\s*\Z)", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
