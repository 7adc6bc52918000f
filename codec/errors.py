"""The project's error base (`TesseraError`) and the one exception type for bytes that do not
decode (`DecodeError`)."""


class TesseraError(Exception):
    """Every error the project raises on purpose, each with a message that says what is wrong
    (and, for an operator's input, how to fix it): the `tessera` command prints it as one line."""


class DecodeError(TesseraError, ValueError):
    """Raised for every malformed, truncated, oversized or inconsistent input to a decoder.

    Decoders never let another exception escape on untrusted bytes: whatever is wrong with the
    input (bad magic, lying lengths, out-of-range indices, non-finite scales, ...) surfaces as a
    `DecodeError` whose message says what was wrong.
    """
