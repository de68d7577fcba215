"""The MaxText end-to-end tests' mark: @pytest.mark.runs(*names), the training runs a test reads (test_train.py
starts those of the selected tests together)."""


def pytest_configure(config):
  config.addinivalue_line("markers", "runs(*names): the training runs of test_train.RUNS a test reads")
