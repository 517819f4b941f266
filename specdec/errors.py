"""The one exception type specdec raises for bad input: the message says what was wrong and what to do;
and `counted`, the one plural rule of the messages specdec prints."""


class SpecdecError(ValueError):
    pass


def counted(n: float, noun: str) -> str:
    """'1 token', '8 tokens', '0.35 cores': n and the noun, plural unless n is 1 (nouns that add an s)."""
    return f"{n:g} {noun}" if n == 1 else f"{n:g} {noun}s" if isinstance(n, float) else f"{n} {noun}s"
