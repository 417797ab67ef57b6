"""What tests share, in one place: conftest.py keeps the fixtures and takes what it needs from
here; test modules import from here, never from one another or from a conftest.py (the root
conftest.py refuses a suite that does).

payloads   engines pinned at the wire with `responses`: the params and replies P and D give
servers    real processes: emulated engines, gateways under gunicorn, what they report
emulator   the emulator's own tests: a P/D pair driven by hand, as a gateway drives it
"""
