"""Write image digests into a chart's values.yaml, so that the packaged chart's defaults pull the
images by digest (the release workflow runs it on the chart it publishes, after pushing the images):

    python scripts/set_image_digests.py charts/tandem/values.yaml gateway=sha256:... workerCpu=sha256:...

Each key is an entry of ``images:`` (gateway, router, workerCpu, workerGpu, operator, redis); its
``digest: ""`` line gets the digest. The rest of the file (comments, order) is left as it is; the
result is checked by reading it back."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def set_digests(text: str, digests: dict[str, str]) -> str:
    lines = text.splitlines(keepends=True)
    try:
        start = lines.index("images:\n")
    except ValueError:
        raise SystemExit("no top-level 'images:' in the values file") from None
    current = ""
    done: set[str] = set()
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.strip() and not line.startswith(" "):
            break  # the next top-level key
        entry = re.match(r"^  ([A-Za-z]+):\s*$", line)
        if entry:
            current = entry.group(1)
        elif current in digests and re.match(r"^    digest: .*$", line):
            lines[i] = f'    digest: "{digests[current]}"\n'
            done.add(current)
    missing = set(digests) - done
    if missing:
        raise SystemExit(f"no images.<key>.digest line for {sorted(missing)}")
    result = "".join(lines)
    images = yaml.safe_load(result)["images"]
    for key, digest in digests.items():
        assert images[key]["digest"] == digest, key
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    digests: dict[str, str] = {}
    for pair in argv[1:]:
        key, _, digest = pair.partition("=")
        if not DIGEST.match(digest):
            raise SystemExit(f"{key}: {digest!r} is not a sha256 digest")
        digests[key] = digest
    path.write_text(set_digests(path.read_text(), digests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
