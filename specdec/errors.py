"""The one exception type specdec raises for bad input: the message says what was wrong and what to do."""


class SpecdecError(ValueError):
    pass
