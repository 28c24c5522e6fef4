"""Where the checkout and its data live; imports nothing heavy (env worker processes load it and start fast)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_dir(*parts):
    """The data folder: $SHARED, else ../shared beside the checkout (the offline Qwen2.5 tokenizer/configs, the
    ALFWorld archive, WebShop's catalog, the Search questions and corpus); `parts` are joined below it."""
    return os.path.join(os.environ.get("SHARED", os.path.join(os.path.dirname(REPO), "shared")), *parts)
