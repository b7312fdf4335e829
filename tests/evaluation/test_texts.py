import importlib.util

import pytest

from lukv_cache import texts
from lukv_cache.texts import (
    TextUnavailableError,
    strip_wiki_markup,
    texts_available,
    wikipedia_articles,
)


def test_strip_wiki_markup_keeps_link_text_and_drops_templates_refs_and_files():
    wikitext = (
        "{{Infobox person|name=X|note={{nested}}}}'''Ada''' was a [[mathematician|maths person]] from "
        "[[London]].<ref>A book, p. 3</ref> [[File:Ada.jpg|thumb|A [[portrait]]]]She wrote notes.<ref name=a/>"
    )
    assert strip_wiki_markup(wikitext) == "Ada was a maths person from London. She wrote notes."


def test_strip_wiki_markup_drops_reference_sections_and_tables():
    wikitext = "Intro text.\n{| class=wikitable\n|a||b\n|}\n== Life ==\nBody.\n== References ==\n* a cite"
    assert strip_wiki_markup(wikitext) == "Intro text.\n\nLife\n\nBody."


def test_missing_gensim_raises_text_unavailable_error_with_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        texts.importlib.util, "find_spec", lambda name: None if name == "gensim" else real_find_spec(name)
    )
    texts._wikipedia_articles.cache_clear()
    try:
        with pytest.raises(TextUnavailableError, match="pip install --no-deps gensim"):
            wikipedia_articles()
        assert texts_available() is False
    finally:
        texts._wikipedia_articles.cache_clear()


@pytest.mark.skipif(not texts_available(), reason="gensim (pip install --no-deps gensim) is not installed")
def test_packaged_wikipedia_articles_are_long_plain_prose():
    articles = wikipedia_articles()
    assert len(articles) > 50
    assert len(wikipedia_articles(min_chars=18_000)) > 40  # ~4k tokens each: enough for long contexts
    for article in articles:
        assert "{{" not in article.text and "[[" not in article.text and "<ref" not in article.text


def test_use_articles_serves_stand_ins_to_every_reader_of_that_source(monkeypatch):
    monkeypatch.setattr(texts, "_STAND_INS", {})  # the process's stand-ins, restored after the test
    long_paragraph = "Made-up prose about a river. " * 10
    texts.use_articles(
        wikipedia=[texts.Article("A", f"{long_paragraph}\n\nshort"), texts.Article("B", "tiny")]
    )
    assert [a.title for a in wikipedia_articles()] == ["A", "B"]
    assert [a.title for a in wikipedia_articles(min_chars=100)] == ["A"]
    assert texts.haystack_paragraphs("wikipedia") == [long_paragraph]
    texts.use_articles(news=[texts.Article("news-000", "A story.")])
    assert [a.title for a in texts.news_articles()] == ["news-000"]
    assert [a.title for a in wikipedia_articles()] == ["A", "B"]  # None left wikipedia's as it was
