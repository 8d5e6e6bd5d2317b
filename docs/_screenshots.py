"""Opens every page of the built site in headless Chromium and fails when wide content is clipped.

``python3 -m nox -s docs_screenshots`` builds the site and runs this; by hand::

    python docs/_screenshots.py site --out screenshots --width 1400

The site is served on 127.0.0.1 only, and Chromium resolves no other host, so a page that would
load something from the network (fonts, scripts) cannot. On each page, at a window ``--width``
pixels wide, it reports:

* a scroll container (a code block, a table, Material's table wrapper) whose content is wider than
  its box (``scrollWidth > clientWidth``): the reader would have to scroll sideways;
* a column-aligned line of a code block (a picture's box drawing, an ``explain`` table: a line
  with box-drawing characters or with a run of two spaces inside it) wider than its block: code
  blocks wrap long lines, which is right for a long error message but breaks a table's columns;
* inline code in a table cell that breaks over several lines (an expression cut in pieces);
* the page itself scrolling sideways.

It saves a screenshot of the top of every page, and one of the widest code block or table of
each page, in ``--out``, to look at. Exits 1 if anything is clipped.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import tempfile
import threading
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

# Flags for a root, offline, throwaway Chromium: no sandbox (root), no GPU, and no background
# traffic (updates, sync, QUIC probes) that this machine's closed network would refuse.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # only the local server is reached
]

MEASURE = r"""
const width = (el) => el.getBoundingClientRect().width;
const firstLine = (el) => (el.textContent || '').trim().split('\n')[0].slice(0, 90);
const root = document.querySelector('article.md-content__inner') || document.body;
const found = [];
for (const el of root.querySelectorAll('*')) {
  const overflow = getComputedStyle(el).overflowX;
  if (!['auto', 'scroll', 'hidden'].includes(overflow)) continue;
  if (el.scrollWidth > el.clientWidth + 1) {
    const name = el.tagName.toLowerCase() + (el.className ? '.' + String(el.className).split(' ')[0] : '');
    found.push({kind: 'scrolls sideways', element: name, text: firstLine(el),
                content: el.scrollWidth, box: el.clientWidth});
  }
}
// The block that comes closest to its box (a column-aligned line of a code block, or a table), for a
// screenshot and the summary.
let widest = null, fill = 0;
const tabular = /[│┃┌┐└┘├┤┬┴┼─━]|\S {2,}\S/;
for (const code of root.querySelectorAll('pre > code')) {
  const style = getComputedStyle(code);
  const room = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  const probe = document.createElement('span');
  probe.style.cssText = 'position:absolute;visibility:hidden;white-space:pre;left:0;top:0';
  code.appendChild(probe);
  for (const line of code.textContent.split('\n')) {
    if (!tabular.test(line)) continue;
    probe.textContent = line;
    if (width(probe) / room > fill) { fill = width(probe) / room; widest = code; }
    if (width(probe) > room + 0.5) {
      found.push({kind: 'columns wrap', element: 'pre > code', text: line.trim().slice(0, 90),
                  content: Math.ceil(width(probe)), box: Math.floor(room)});
    }
  }
  probe.remove();
}
for (const code of root.querySelectorAll('td code, th code')) {
  if (code.getClientRects().length > 1) {
    found.push({kind: 'cell code breaks', element: 'td code', text: code.textContent.slice(0, 90),
                content: code.getClientRects().length, box: 1});
  }
}
const page = document.documentElement;
if (page.scrollWidth > page.clientWidth + 1) {
  found.push({kind: 'page scrolls sideways', element: 'html', text: document.title,
              content: page.scrollWidth, box: page.clientWidth});
}
for (const el of root.querySelectorAll('table')) {
  const ratio = el.scrollWidth / Math.max(1, root.clientWidth);
  if (ratio > fill) { fill = ratio; widest = el; }
}
if (widest) widest.setAttribute('data-widest', '1');
return JSON.stringify({found, fill, height: page.scrollHeight});
"""


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _pages(site: Path) -> list[str]:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html"))
    return [p.removesuffix("index.html") for p in pages]


def _browser(width: int, profile: str, chromium: str, chromedriver: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},1000"]:
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    browser.set_window_size(width, 1000)
    return browser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir)")
    parser.add_argument("--out", type=Path, required=True, help="where the screenshots go")
    parser.add_argument("--width", type=int, default=1400, help="the window's width in pixels")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server, base = _serve(args.site)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        browser = _browser(args.width, profile, args.chromium, args.chromedriver)
        try:
            inner = browser.execute_script("return window.innerWidth")
            print(f"Chromium {browser.capabilities.get('browserVersion')}, window {inner} px wide")
            for page in _pages(args.site):
                browser.get(f"{base}/{page}")
                browser.execute_async_script("document.fonts.ready.then(() => arguments[0]())")
                result = json.loads(browser.execute_script(MEASURE))
                name = re.sub(r"[^\w]+", "_", page.strip("/")) or "index"
                browser.save_screenshot(str(args.out / f"{name}.png"))
                widest = browser.find_elements(By.CSS_SELECTOR, "[data-widest]")
                if widest:
                    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", widest[0])
                    widest[0].screenshot(str(args.out / f"{name}.widest.png"))
                fill = f"the widest column-aligned block fills {result['fill']:.0%} of its width"
                print(f"{page or '/'}: {len(result['found'])} clipped, {fill}")
                for item in result["found"]:
                    problems.append(
                        f"{page or '/'}: {item['kind']} ({item['element']}, {item['content']} > "
                        f"{item['box']} px): {item['text']!r}"
                    )
        finally:
            browser.quit()
            server.shutdown()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} clipped blocks; screenshots in {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
