"""What several tests share: plain functions, constants and the models configs name
(`tests.helpers.real_models:gpt2`). Fixtures stay in conftest.py, where pytest finds them."""
