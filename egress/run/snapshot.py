"""Policy files the confined command can write are read once, when the run starts.

``egress run`` reads the user's policy before the command runs, but builds the
proxy's policy later (when the command first connects) and reloads it on every
edit. A policy file inside the project (or any folder the command can write)
would then be the command's to rewrite: it could grant itself any host. So the
launcher reads policy files through a :class:`PolicySnapshot`:

* while the run starts, files are read for real and every text is kept;
* :meth:`PolicySnapshot.seal` (before the proxy can start) keeps the texts of
  the files the launcher's predicate says the command can write, and drops the rest;
* from then on such a file is served from its recorded text (and named by the
  place it resolved to then), never read again; a file the command can write that
  was not read at start (say, a new include pointing into the project) is refused;
  every other file is read as it is now, so edits to it still apply live.
"""

from __future__ import annotations

from collections.abc import Callable

# pathlib's Path (the policy loader's paths, in the annotations) is imported only where one is made:
# `egress run` never imports pathlib (egress.proxy.ca says why).
TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from pathlib import Path

# egress.policy's loader is imported only when needed: every `egress run` makes a PolicySnapshot,
# most never load a policy file (the loader's imports: bench/README.md, "Launcher").

REFUSED = "inside a folder the command can write; only files read when the run started are used"


class PolicySnapshot:
    """A policy read hook (``read(path) -> str``) for one run; see the module's docstring."""

    def __init__(self) -> None:
        self._frozen: Callable[[str], bool] | None = None  # set by seal()
        # absolute path as given -> (where it resolved to when read, its text)
        self._texts: dict[str, tuple[Path, str]] = {}

    def __call__(self, path: Path) -> str:
        key = str(path.absolute())
        if key in self._texts:
            return self._texts[key][1]
        if self._frozen is None:  # the run is starting: read and remember
            resolved = path.resolve()
            text = path.read_text(encoding="utf-8")
            self._texts[key] = (resolved, text)
            return text
        if self._can_write(key):
            from egress.policy.loader import ReadRefused

            raise ReadRefused(REFUSED)
        return path.read_text(encoding="utf-8")

    def resolve(self, path: Path) -> Path:
        """Where the loader should take ``path`` to lead: where it led when recorded."""
        recorded = self._texts.get(str(path.absolute()))
        return recorded[0] if recorded is not None else path.resolve()

    def seal(self, frozen: Callable[[str], bool]) -> None:
        """The run has started: keep only the files ``frozen(path)`` says the command can write."""
        self._frozen = frozen
        self._texts = {key: kept for key, kept in self._texts.items() if self._can_write(key)}
        if self._texts:
            from egress.policy.loader import pin_text

            for resolved, text in self._texts.values():
                pin_text(str(resolved), text)  # file:line in events names the text in force

    def recorded(self) -> list[tuple[str, str, str]]:
        """What a sealed snapshot serves: (path as given, where it resolved to, text) per file;
        for another process to rebuild it (egress run's warm proxy, egress.run.warm.server)."""
        return [(key, str(resolved), text) for key, (resolved, text) in self._texts.items()]

    @classmethod
    def sealed(cls, recorded, frozen: Callable[[str], bool]) -> PolicySnapshot:
        """The snapshot another process sealed, from its :meth:`recorded` files, sealed with the
        same predicate (so the same files are served from their text, and new ones refused)."""
        from pathlib import Path

        snapshot = cls()
        snapshot._texts = {key: (Path(resolved), text) for key, resolved, text in recorded}
        snapshot.seal(frozen)
        return snapshot

    def _can_write(self, path: str) -> bool:
        try:
            return bool(self._frozen(path))
        except Exception:  # a predicate that cannot answer: assume the command can write it
            return True

    @property
    def frozen_files(self) -> frozenset[str]:
        """The recorded files, as given and as resolved then (what a watcher may see change)."""
        return frozenset(self._texts) | {str(resolved) for resolved, _ in self._texts.values()}
