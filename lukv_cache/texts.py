"""Real English text without the network: files shipped inside installed PyPI packages.

* Wikipedia: ``gensim`` ships 106 full English Wikipedia articles (a shortened 2016 dump) in its test data;
  :func:`wikipedia_articles` parses the XML with the standard library and strips the wiki markup.
* News: ``gensim``'s ``lee_background.cor``, 300 short Australian news articles, one per line
  (:func:`news_articles`).
* Python's reference documentation (``pydoc_data``, shipped with CPython itself; its content follows the
  interpreter's version): 79 topics of technical prose and code (:func:`python_docs`).

The files are read from the package directory (found with ``importlib.util.find_spec``); gensim itself is
never imported, so ``pip install --no-deps gensim`` is enough.

    >>> from lukv_cache.texts import wikipedia_articles
    >>> articles = wikipedia_articles()  # doctest: +SKIP
    >>> articles[0].title, len(articles)  # doctest: +SKIP
    ('Anarchism', 101)
"""

from __future__ import annotations

import bz2
import functools
import html
import importlib.util
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigurationError, TextUnavailableError

GENSIM_INSTALL = "pip install --no-deps gensim"
_WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_NEWS_FILE = "lee_background.cor"
# Sections after which a Wikipedia article is only lists of links and citations, not prose.
_TAIL_SECTIONS = (
    "See also",
    "References",
    "Notes",
    "External links",
    "Further reading",
    "Bibliography",
    "Sources",
    "Footnotes",
    "Citations",
)


@dataclass(frozen=True)
class Article:
    """One real document: its title and its plain text (paragraphs separated by blank lines).

    >>> Article("Title", "Some text.").text
    'Some text.'
    """

    title: str
    text: str


def _test_data_dir() -> Path:
    # find_spec locates gensim without importing it (its import needs scipy and compiled extensions).
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise TextUnavailableError(
            f"Real text for the demo and benchmarks comes from the 'gensim' package. Install it with: "
            f"{GENSIM_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"
    if not (path / _WIKI_FILE).is_file():
        raise TextUnavailableError(f"{path / _WIKI_FILE} is missing; reinstall with: {GENSIM_INSTALL}")
    return path


def texts_available() -> bool:
    """True when the text files can be read.

    >>> isinstance(texts_available(), bool)
    True
    """
    try:
        _test_data_dir()
    except TextUnavailableError:
        return False
    return True


def _drop_balanced(text: str, opening: str, closing: str) -> str:
    """Remove every balanced ``opening ... closing`` span, nested ones included (templates, tables)."""
    out: list[str] = []
    depth = 0
    i = 0
    while i < len(text):
        if text.startswith(opening, i):
            depth += 1
            i += len(opening)
        elif depth and text.startswith(closing, i):
            depth -= 1
            i += len(closing)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


_LINK = re.compile(r"\[\[([^\[\]|]*)(?:\|([^\[\]]*))?\]\]")
_FILE_LINK_PREFIX = re.compile(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):", re.IGNORECASE)


def _drop_file_links(text: str) -> str:
    """``[[File:...|caption with [[links]]]]`` and ``[[Category:...]]``: drop the whole nested span."""
    while True:
        match = _FILE_LINK_PREFIX.search(text)
        if not match:
            return text
        depth, i = 0, match.start()
        while i < len(text):
            if text.startswith("[[", i):
                depth, i = depth + 1, i + 2
            elif text.startswith("]]", i):
                depth, i = depth - 1, i + 2
                if depth == 0:
                    break
            else:
                i += 1
        text = text[: match.start()] + text[i:]


def strip_wiki_markup(wikitext: str) -> str:
    """Wiki markup to plain prose: drops templates, tables, references, files, categories, HTML and the
    list-only tail sections; keeps link texts and headings as their own paragraphs.

    >>> strip_wiki_markup("'''Paris''' is the [[capital city|capital]] of [[France]].{{citation needed}}")
    'Paris is the capital of France.'
    """
    text = html.unescape(wikitext)  # the dump escapes once more inside <text>
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.DOTALL)
    text = re.sub(
        r"<(gallery|math|timeline|score|syntaxhighlight|source)[^>]*>.*?</\1>", "", text, flags=re.DOTALL
    )
    text = _drop_balanced(text, "{{", "}}")
    text = _drop_balanced(text, "{|", "|}")
    text = _drop_file_links(text)
    for _ in range(3):  # links inside link captions
        text = _LINK.sub(lambda m: m.group(2) if m.group(2) is not None else m.group(1), text)
    text = re.sub(r"\[https?://[^\s\]]+\s*([^\]]*)\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    tail = "|".join(re.escape(name) for name in _TAIL_SECTIONS)
    text = re.split(rf"\n==+\s*(?:{tail})\s*==+", text)[0]

    paragraphs: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        heading = re.fullmatch(r"(=+)\s*(.*?)\s*\1", line)
        if heading:
            line = heading.group(2)
        line = re.sub(r"^[*#:;]+\s*", "", line)
        line = re.sub(r"\s+", " ", line).strip()
        # Leftovers of broken markup and one-word list items read as noise; keep sentences and headings.
        if not line or line.startswith(("|", "!", "{", "}")):
            continue
        paragraphs.append(line)
    prose = "\n\n".join(paragraphs)
    prose = re.sub(r"\(\s*[,;]?\s*\)", "", prose)  # "( )" left by a removed template
    prose = re.sub(r" +([,.;:])", r"\1", prose)
    return prose.strip()


@functools.cache
def _wikipedia_articles() -> tuple[Article, ...]:
    namespace = "{http://www.mediawiki.org/xml/export-0.10/}"
    articles: list[Article] = []
    with bz2.open(_test_data_dir() / _WIKI_FILE, "rb") as stream:
        for _, element in ET.iterparse(stream, events=("end",)):
            if element.tag != f"{namespace}page":
                continue
            title = element.findtext(f"{namespace}title") or ""
            ns = element.findtext(f"{namespace}ns")
            body = element.findtext(f"{namespace}revision/{namespace}text") or ""
            is_redirect = element.find(f"{namespace}redirect") is not None
            element.clear()
            if ns != "0" or is_redirect or body.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = strip_wiki_markup(body)
            if len(text) > 2000:
                articles.append(Article(title, text))
    return tuple(articles)


def wikipedia_articles(min_chars: int = 0) -> list[Article]:
    """The Wikipedia articles shipped in gensim's test data, as plain text, in dump order.

    ``min_chars`` keeps only articles at least that long (about 4.5 characters per SmolLM2 token).

    >>> long_ones = wikipedia_articles(min_chars=20_000)  # doctest: +SKIP
    """
    return [a for a in _articles("wikipedia") if len(a.text) >= min_chars]


@functools.cache
def _news_articles() -> tuple[Article, ...]:
    lines = (_test_data_dir() / _NEWS_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    return tuple(
        Article(f"news-{i:03d}", " ".join(line.split())) for i, line in enumerate(lines) if line.strip()
    )


def news_articles() -> list[Article]:
    """The 300 news articles of gensim's ``lee_background.cor`` (one paragraph each).

    >>> len(news_articles())  # doctest: +SKIP
    300
    """
    return list(_articles("news"))


# what :func:`use_articles` serves in place of gensim's files, by source ("wikipedia", "news")
_STAND_INS: dict[str, tuple[Article, ...]] = {}


def use_articles(
    *, wikipedia: Iterable[Article] | None = None, news: Iterable[Article] | None = None
) -> None:
    """Serve these articles in place of gensim's for the rest of the process (a smoke run or a test on
    made-up prose, with or without gensim): :func:`wikipedia_articles`, :func:`news_articles` and
    :func:`haystack_paragraphs` read them. ``None`` leaves that source as it was. :func:`texts_available`
    still says whether gensim's files are there.
    """
    if wikipedia is not None:
        _STAND_INS["wikipedia"] = tuple(wikipedia)
    if news is not None:
        _STAND_INS["news"] = tuple(news)


def _articles(source: str) -> tuple[Article, ...]:
    if source in _STAND_INS:
        return _STAND_INS[source]
    return _wikipedia_articles() if source == "wikipedia" else _news_articles()


def python_docs() -> list[Article]:
    """The topics of Python's reference documentation that ``help()`` shows (``pydoc_data.topics``, part
    of every CPython install), in name order. The text is the running interpreter's version's.

    >>> docs = python_docs()
    >>> len(docs) > 50 and all(d.text for d in docs)
    True
    """
    from pydoc_data.topics import topics

    return [Article(name, topics[name].strip()) for name in sorted(topics)]


def haystack_paragraphs(source: str = "wikipedia") -> list[str]:
    """Every paragraph of a source (``"wikipedia"`` or ``"news"``) that reads as prose (>= 200 chars).

    Short paragraphs are mostly headings and list items; dropping them keeps the haystack fluent.

    >>> paragraphs = haystack_paragraphs("news")  # doctest: +SKIP
    """
    if source in ("wikipedia", "news"):
        articles = _articles(source)
    else:
        raise ConfigurationError(f"Unknown text source {source!r}; use 'wikipedia' or 'news'.")
    return [p for a in articles for p in a.text.split("\n\n") if len(p) >= 200]
