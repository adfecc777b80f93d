import pytest

from bayesify.zoo.data import DataBundle, InMemoryDataset, load_data


@pytest.fixture(scope="session")
def digits() -> DataBundle:
    """A small slice of sklearn digits: 320 training and 100 test images."""
    full = load_data("digits")
    train, test = full.train, full.test
    return DataBundle(
        "digits", InMemoryDataset(train.inputs[:320], train.labels[:320]), InMemoryDataset(test.inputs[:100], test.labels[:100]),
        10, (1, 8, 8), full.kind, full.mean, full.std,
    )  # fmt: skip
