"""The committed speech clips (see tests/fixtures/audio/README.md for how they were made)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
ENGLISH = FIXTURES / "deliver-umbrellas.en.ogg"  # "Please deliver seven purple umbrellas ..."
GERMAN = FIXTURES / "kaffee.de.ogg"  # "Ich trinke jeden Morgen eine Tasse Kaffee."
NOT_AUDIO = FIXTURES / "not-audio.txt"
