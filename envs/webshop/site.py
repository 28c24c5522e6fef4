"""The shopping site as text: its pages, what can be clicked on each, and the moves between them, as the
original's Flask pages (templates/*.html) read in its 'text' observation mode, without the HTML.

    search page   'Search'                                       search[<query>]
    results       'Back to Search' 'Page 1 (Total results: 50)' ['< Prev'] 'Next >'
                  then per product (10 a page of the top 50): asin, title, price
                                                                 click[back to search | < prev | next > | <asin>]
    item page     'Back to Search' '< Prev', per option group its name and values, title, 'Price: $x',
                  'Rating: N.A.', 'Description' 'Features' 'Reviews' 'Buy Now'
                                                                 click[back to search | < prev | description |
                                                                 features | reviews | buy now | <option value>]
    sub-pages     'Back to Search' '< Prev' and the description / the bullet points / (no reviews)
    done          after buy now: the score; the episode ends

The observation is the page's text parts, each in single quotes, joined by ' [SEP] ' (the original's text mode
as verl-agent passes it on: the lines up to the instruction are cut, since the prompt has its own task line).
Clickables are the lower-cased button texts, the asins (lower-cased) and the option values, as the original's
`get_available_actions`; the admissible list is 'search[<your query>]' on the search page and 'click[x]' for
each clickable.

An action is `search[query]` (any page, a non-empty query, as the original allows) or `click[x]` with x a
clickable of the current page. Anything else, an empty search included, leaves the page as it is (reward 0,
not done). The original keeps a few page quirks that are kept here: 'Next >' shows on every results page (past
the last it shows an empty page), the sub-pages keep the chosen options, '< Prev' from an item forgets them,
the Reviews page is empty (the original never loads reviews), and the selected options are not marked in the
text. Differences: 'click[search]' (the search button, which the original lists but refuses) is left out of
the admissible list; the argument inside the brackets is stripped of outer spaces; a query is cut to
MAX_QUERY_CHARS characters.
"""
import re

from envs.webshop.scoring import score_purchase

SEP = " [SEP] "
PAGE_SIZE = 10  # the original's PRODUCT_WINDOW
MAX_QUERY_CHARS = 500  # a longer search[...] is cut here (the prompt's 512-token response bounds it anyway)
SEARCH_ACTION = "search[<your query>]"
BACK, PREV, NEXT, BUY = "Back to Search", "< Prev", "Next >", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")
ACTION_RE = re.compile(r"(search|click)\[(.*)\]", re.DOTALL)


def parse_site_action(action):
    """'search[red shoes]' -> ('search', 'red shoes'); ('', '') when it is neither form."""
    m = ACTION_RE.fullmatch(str(action).strip())
    return (m.group(1), m.group(2).strip().lower()) if m else ("", "")


class Site:
    """One shopper's session on the site, playing one goal. `step(action)` -> whether the action did
    anything; `view()` -> (text parts, clickables {text: (kind, arg)}); `done`, `score`, `details`."""

    def __init__(self, catalog, engine, goal, tagger="auto"):
        self.catalog, self.engine, self.goal, self.tagger = catalog, engine, goal, tagger
        self.done, self.score, self.details = False, 0.0, None
        self.go_search_page()

    # ---- moves
    def go_search_page(self):
        self.page, self.results, self.page_no, self.asin, self.options = "search", [], 1, None, {}

    def search(self, query):
        self.results = [self.catalog.products[i]["asin"] for i in self.engine.search(query[:MAX_QUERY_CHARS])]
        self.page, self.page_no, self.asin, self.options = "results", 1, None, {}

    def buy(self):
        product = self.catalog.by_asin[self.asin]
        self.score, self.details = score_purchase(product, self.options, self.catalog.prices[self.asin],
                                                  self.goal, self.tagger)
        self.page, self.done = "done", True

    def step(self, action):
        if self.done:
            return False
        name, arg = parse_site_action(action)
        if name == "search" and arg:
            self.search(arg)
            return True
        clickables = self.view()[1]
        if name != "click" or arg not in clickables:
            return False
        kind, value = clickables[arg]
        if kind == "back":
            self.go_search_page()
        elif kind == "next":
            self.page_no += 1
        elif kind == "prev" and self.page == "results":
            self.page_no -= 1
        elif kind == "prev" and self.page == "item":  # back to the results; the options are forgotten
            self.page, self.asin, self.options = "results", None, {}
        elif kind == "prev":  # from a sub-page to its item
            self.page = "item"
        elif kind == "asin":
            self.page, self.asin = "item", value
        elif kind == "option":
            self.options[value] = arg
        elif kind == "sub":
            self.page = value
        elif kind == "buy":
            self.buy()
        return True

    # ---- what the page shows
    def view(self):
        if self.page == "search":
            return ["Search"], {}
        if self.page == "done":
            return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", str(self.score)], {}
        click = {BACK.lower(): ("back", None)}
        if self.page == "results":
            shown = self.results[(self.page_no - 1) * PAGE_SIZE:self.page_no * PAGE_SIZE]
            parts = [BACK, f"Page {self.page_no} (Total results: {len(self.results)})"]
            if self.page_no > 1:
                parts.append(PREV)
                click[PREV.lower()] = ("prev", None)
            parts.append(NEXT)
            click[NEXT.lower()] = ("next", None)
            for asin in shown:
                p = self.catalog.by_asin[asin]
                parts += [asin, p["Title"], p["Price"]]
                click[asin.lower()] = ("asin", asin)
            return parts, click
        p = self.catalog.by_asin[self.asin]
        click[PREV.lower()] = ("prev", None)
        if self.page != "item":  # a sub-page
            body = {"Description": [p["Description"]], "Features": p["BulletPoints"], "Reviews": []}[self.page]
            return [BACK, PREV] + [t for t in body if t.strip()], click
        parts = [BACK, PREV]
        for name, values in p["options"].items():
            parts += [name] + values
        parts += [p["Title"], f"Price: {p['Price']}", "Rating: N.A.", *SUB_PAGES, BUY]
        for sub in SUB_PAGES:
            click[sub.lower()] = ("sub", sub)
        click[BUY.lower()] = ("buy", None)
        for name, values in p["options"].items():  # radio buttons come after the buttons, as the original's
            for v in values:
                click[v] = ("option", name)
        return parts, click

    def observation(self):
        parts, _ = self.view()
        return SEP.join(f"'{t.strip()}'" for t in parts)

    def admissible(self):
        _, click = self.view()
        return ([SEARCH_ACTION] if self.page == "search" else []) + [f"click[{c}]" for c in click]
