"""Check that a document's names can be found in the tree: every `backticked` path exists, every backticked
code name (``Class``, ``Class.method``, ``function``, ``module.name``) is defined somewhere in the tree's
``*.py``, and so is every such name in its fenced blocks (the walks drawn as text, the mermaid chart).

    python scripts/check_doc_names.py docs/architecture.md

Prints each name it cannot find and exits 1 if there is one. A name counts as defined when some ``*.py``
holds ``def NAME``, ``class NAME``, ``NAME =``, ``NAME:`` (a field or annotated attribute) or ``self.NAME =``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"^[\w.\-]+(/[\w.\-<>{},*]*)+$|^[\w\-]+\.(py|toml|md|tcss)$")
CODE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(.*\))?$")
# in drawings: Dotted.names, CamelCase words with a lower-case letter, and snake_case names with an underscore
DRAWN = re.compile(r"\b(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*\b|\b[A-Z][a-z]+[A-Z]\w*\b|\b_?[a-z]+_[a-z_]+\b")
#: words that are prose or other tools' names, not this tree's code
IGNORE = {"asyncio", "torch", "json", "typer", "textual", "asyncssh", "numba", "numpy", "cryptography", "dcap_qvl",
          "import-linter", "lint-imports", "grimp", "mypy", "ruff", "torchrun", "ddp_comm_hooks", "signxml",
          "lxml", "torch.distributed", "settings.json", "holders.toml", "fleet.key", "key_chunk_budget",
          "epoch_limit", "dead_epochs", "frame.header", "grant.provisioning_key", "h.key.key", "w.key",
          "rekey_to", "wrapped_key", "session_id", "chunk_size", "frame_type", "train_off", "train_len",
          "key_fp", "nonce_budget", "checkpoint_every", "protocol_cost_pct", "max_steps", "budget_s",
          "data_path", "init_from", "sub_window", "train_slices", "engine.train_slices", "engine.subscribe",
          "engine.bus.sinks", "engine.bus.probes", "TrainResult.done", "self.window"}


def tracked_py(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, check=True, capture_output=True, text=True)
    return [root / p for p in out.stdout.split()]


def defined_names(root: Path) -> dict[str, set[str]]:
    """Each defined name and the files (stems) that define it."""
    names: dict[str, set[str]] = {}
    pattern = re.compile(r"^[ \t]*(?:async[ \t]+def|def|class)[ \t]+(\w+)"
                         r"|^[ \t]*(?:self\.)?(\w+)[ \t]*(?::[^=\n]*)?="
                         r"|^[ \t]*(\w+)[ \t]*:", re.M)
    for path in tracked_py(root):
        for m in pattern.finditer(path.read_text(errors="replace")):
            for g in m.groups():
                if g:
                    names.setdefault(g, set()).add(str(path))
        names.setdefault(path.stem, set()).add(str(path))
    return names


def module_paths(root: Path) -> dict[str, set[str]]:
    """Dotted module names (``keys``, ``protocol.keys``, ``gputravel.core.protocol.keys``, packages too) -> files."""
    mods: dict[str, set[str]] = {}
    for path in tracked_py(root):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        for i in range(len(parts)):
            mods.setdefault(".".join(parts[i:]), set()).add(str(path))
        mods.setdefault(".".join(["gputravel", *parts]), set()).add(str(path))
    return mods


def check(doc: Path, root: Path) -> list[str]:
    text = doc.read_text()
    names, mods = defined_names(root), module_paths(root)
    files = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout.split()
    missing: list[str] = []
    checked = 0

    def code_ok(token: str) -> bool:
        token = token.split("(")[0]
        if token in IGNORE or token in mods:
            return True
        if (root / token).is_file():
            return True
        parts = token.split(".")
        if parts[-1] not in names:
            return False
        if len(parts) == 1:
            return True
        module = ".".join(parts[:-1])
        if module in mods:  # module.name: defined in that module (or it is a submodule of that package)
            return bool(mods[module] & names[parts[-1]]) or token in mods
        # Class.method: both defined in one file, or the class's file imports the file defining the method's
        # owner (a mixin or base class, as DeviceService takes submit_chunk from ChunkIntake)
        owner, member = parts[-2], parts[-1]
        if owner not in names:
            return False
        return defines(owner, member, depth=3)

    def defines(owner: str, member: str, *, depth: int) -> bool:
        """``member`` is in a file defining ``owner``, or (through ``class Owner(Base)``) in a base's."""
        if names.get(owner, set()) & names.get(member, set()):
            return True
        if depth == 0:
            return False
        for f in names.get(owner, set()):
            m = re.search(rf"^[ \t]*class[ \t]+{owner}\(([^)]*)\)", Path(f).read_text(), re.M)
            bases = re.findall(r"\b([A-Z]\w*)", m.group(1)) if m else []
            if any(defines(b, member, depth=depth - 1) for b in bases):
                return True
        return False

    fenced = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for token in re.findall(r"`([^`]+)`", prose):
        token = " ".join(token.split())
        if " " in token:  # a command: check the paths in it
            for word in token.split():
                if "/" in word and PATH.match(word) and not _exists(root, word):
                    missing.append(f"path: {word} (in `{token}`)")
        elif "/" in token and PATH.match(token):
            checked += 1
            if not _exists(root, token):
                missing.append(f"path: {token}")
        elif token in IGNORE:
            continue
        elif re.fullmatch(r"[\w\-]+\.(py|toml|tcss|md)", token):  # a bare file name: some tracked file has it
            checked += 1
            if not any(f.endswith("/" + token) or f == token for f in files):
                missing.append(f"file: {token}")
        elif CODE.match(token) and (("." in token) or "_" in token or re.match(r"[A-Z][a-z]+[A-Z]", token)):
            checked += 1
            if not code_ok(token):
                missing.append(f"name: {token}")
    for _lang, body in fenced:
        for token in set(DRAWN.findall(body)):
            if "/" in token or token.endswith((".py", ".md")):
                continue
            checked += 1
            if not code_ok(token):
                missing.append(f"drawn: {token}")
        for token in set(re.findall(r"\b(?:core|agents|console|tests|scripts|docs)/[\w/.]+", body)):
            if not (root / token.rstrip("/.")).exists():
                missing.append(f"drawn path: {token}")
    print(f"{doc}: {checked} names and paths checked", file=sys.stderr)
    return sorted(set(missing))


def _exists(root: Path, path: str) -> bool:
    """A path, a glob (``core/policy/*.toml``: one match), or a pattern (``tests/core/<package>/``: the folder
    before it)."""
    path = path.rstrip("/")
    if "*" in path:
        return any(root.glob(path))
    for marker in ("<", "{"):
        if marker in path:
            return (root / (path[: path.index(marker)].rstrip("/") or ".")).exists()
    return (root / path).exists()


def main() -> int:
    doc = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture.md"
    missing = check(doc, ROOT)
    for m in missing:
        print(m)
    print(f"{doc}: {len(missing)} name(s) not found", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
