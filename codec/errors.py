"""The one exception type for bytes that do not decode."""


class DecodeError(ValueError):
    """Raised for every malformed, truncated, oversized or inconsistent input to a decoder.

    Decoders never let another exception escape on untrusted bytes: whatever is wrong with the
    input (bad magic, lying lengths, out-of-range indices, non-finite scales, ...) surfaces as a
    `DecodeError` whose message says what was wrong.
    """
