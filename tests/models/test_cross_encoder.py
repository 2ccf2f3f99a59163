"""The BERT cross-encoder against transformers' own BertForSequenceClassification: the same
pair ids (cut longest first), the same scores through the activation sentence-transformers'
CrossEncoder.predict applies by default, one forward for many documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_reranker import config_of, make_tiny_reranker

from modelhost.models.networks.cross_encoder import load_cross_encoder, longest_first
from modelhost.models.networks.cross_encoder_config import cross_encoder_refusal

WINDOW = 64  # small, so that pairs are cut
QUERY = "what does a giant panda eat?"
DOCUMENTS = [
    "The giant panda eats bamboo almost exclusively.",
    "Paris is the capital of France.",
    "bamboo shoots and leaves " * 30,  # longer than the window
    "pandas",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reranker")
    # A wider initialiser than BERT's 0.02 spreads the random scores apart.
    return make_tiny_reranker(path, max_positions=WINDOW, initializer_range=0.3)


def reference_logits(folder: Path, query: str, documents: list[str]) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(
        [query] * len(documents),
        documents,
        padding=True,
        truncation="longest_first",
        max_length=WINDOW,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits: torch.Tensor = model(**batch).logits.squeeze(-1)
    return logits


def test_scores_equal_transformers_logits_through_a_sigmoid_by_default(folder: Path) -> None:
    model = load_cross_encoder(folder)
    ours = model.score([model.pair(model.tokens(QUERY), model.tokens(d)) for d in DOCUMENTS])
    expected = torch.sigmoid(reference_logits(folder, QUERY, DOCUMENTS))
    assert torch.allclose(torch.tensor(ours), expected, atol=1e-5)
    assert max(ours) - min(ours) > 1e-3  # the documents are told apart


def test_a_config_naming_identity_scores_the_raw_logit(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "identity"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    raw = {**config_of(folder), "sbert_ce_default_activation_function": "torch.nn.Identity"}
    (copy / "config.json").write_text(json.dumps(raw))
    model = load_cross_encoder(copy)
    ours = model.score([model.pair(model.tokens(QUERY), model.tokens(d)) for d in DOCUMENTS])
    assert torch.allclose(torch.tensor(ours), reference_logits(folder, QUERY, DOCUMENTS), atol=1e-5)


@pytest.mark.parametrize(
    ("query", "document"),
    [
        (QUERY, "bamboo " * 100),  # the document is cut, the query kept
        ("bamboo " * 100, "pandas eat bamboo"),  # the query is the longer: it is cut
        ("panda " * 50, "bamboo " * 50),  # both over half: both cut to halves
    ],
)
def test_pairs_are_cut_as_hugging_face_tokenizers_cut_longest_first(
    folder: Path, query: str, document: str
) -> None:
    model = load_cross_encoder(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    expected = tokenizer(query, document, truncation="longest_first", max_length=WINDOW)
    pair = model.pair(model.tokens(query), model.tokens(document))
    assert pair.input_ids == expected["input_ids"]
    assert pair.token_type_ids == expected["token_type_ids"]


def test_longest_first_keeps_a_pair_that_fits_whole() -> None:
    assert longest_first(5, 7, 12) == (5, 7)
    assert longest_first(3, 40, 20) == (3, 17)


def test_a_hundred_documents_are_scored_in_one_forward(folder: Path) -> None:
    model = load_cross_encoder(folder)
    query = model.tokens(QUERY)
    pairs = [
        model.pair(query, model.tokens(f"document number {i} about bamboo")) for i in range(100)
    ]
    scores = model.score(pairs)
    assert len(scores) == 100 and model.forwards == 1


def test_only_one_label_bert_family_classifiers_are_served_as_rerankers(folder: Path) -> None:
    raw = config_of(folder)
    assert cross_encoder_refusal(raw) is None
    deberta = {
        **raw,
        "model_type": "deberta-v2",
        "architectures": ["DebertaV2ForSequenceClassification"],
    }
    assert "not served yet" in (cross_encoder_refusal(deberta) or "")
    two = {**raw, "id2label": {"0": "no", "1": "yes"}}
    assert "one label" in (cross_encoder_refusal(two) or "")
