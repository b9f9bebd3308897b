import os

import openai
import pytest

BASE_URL = os.environ.get("LILY_BASE_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("LILY_API_KEY", "")
MODEL = os.environ.get("LILY_MODEL_ID", "lily-tiny-shakespeare")


@pytest.fixture(scope="session")
def client():
    return openai.OpenAI(base_url=BASE_URL + "/v1", api_key=API_KEY or "none", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model():
    return MODEL


@pytest.fixture(scope="session")
def base_url():
    return BASE_URL


@pytest.fixture(scope="session")
def api_key():
    return API_KEY
