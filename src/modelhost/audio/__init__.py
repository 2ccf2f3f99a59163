"""Speech to text: Whisper (faster-whisper on CTranslate2) behind `/v1/audio/*`.

`whisper_files` finds and prepares model directories, `decode` turns uploaded audio into
samples, `stage` runs the model one request at a time, `formats` writes the response formats.
"""

from modelhost.audio.transcriber import TranscriptionStage, load_transcriber
from modelhost.audio.whisper_files import WHISPER_BASE, is_whisper_dir, whisper_base_dir

__all__ = [
    "WHISPER_BASE",
    "TranscriptionStage",
    "is_whisper_dir",
    "load_transcriber",
    "whisper_base_dir",
]
