//! Measured convolution algorithms on disk, in the kernel cache's folder ([`PtxCache`]): each
//! `cudnnFind*` runs every algorithm of a direction, and a training job measures three
//! directions of every convolution shape it meets, so a process reads the choices an earlier
//! one made on the same kind of GPU instead of measuring them again. One small text file per
//! [`ConvKey`], named by the MD5 of the device's identity (its name, architecture, driver and
//! cuDNN versions) and the key, and checked against both when read; written atomically. A
//! file that does not read back whole, or whose choice the settings no longer admit, is a
//! miss: the shape is measured afresh and the file rewritten. In deterministic mode a stored
//! choice is the one measuring would make (the first admitted algorithm in a fixed order), so
//! a run resumed from its snapshot computes as the uninterrupted one whether or not it
//! measured; with `fastest` it keeps processes on the same GPU on the same algorithms.

use cudarc::cudnn::sys;

use super::algorithm::{
    choose, AlgorithmSettings, BackwardAlgorithms, Candidate, ConvKey, DeterministicOrder,
    WORKSPACE_LIMIT,
};
use crate::ptx_cache::{md5_hex, PtxCache};

/// The first line of every file: the format's name and version.
const HEADER: &str = "tandem cudnn algorithms 1";

/// The algorithms chosen for one convolution shape: the forward, and the two backward
/// directions once a training plan needed them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StoredChoice {
    /// The forward algorithm.
    pub forward: Candidate<sys::cudnnConvolutionFwdAlgo_t>,
    /// The data- and filter-gradient algorithms, when measured.
    pub backward: Option<BackwardAlgorithms>,
}

/// The measured algorithms of one device, kept in a cache folder.
#[derive(Clone, Debug)]
pub struct AlgorithmStore {
    cache: PtxCache,
    device: String,
}

impl AlgorithmStore {
    /// The store of the device described by `device` (everything that decides what cuDNN
    /// measures besides the shape: the GPU's name and architecture, the driver's and cuDNN's
    /// versions) in `cache`'s folder.
    pub fn new(cache: PtxCache, device: String) -> Self {
        AlgorithmStore { cache, device }
    }

    /// The choice stored for `key`, if its file reads back whole, was written for this device
    /// and key, and is admitted by `settings` (one that is not reads as a miss).
    pub fn load(&self, key: &ConvKey, settings: AlgorithmSettings) -> Option<StoredChoice> {
        let text = std::fs::read_to_string(self.cache.dir.join(self.file_name(key))).ok()?;
        let choice = parse(&text, &self.device, &key_line(key))?;
        admitted(&choice, settings).then_some(choice)
    }

    /// Stores `choice` for `key`. A folder that cannot be written does not stop training (the
    /// next process measures again), so the error is returned for the caller to drop or show.
    pub fn save(
        &self,
        key: &ConvKey,
        choice: &StoredChoice,
    ) -> Result<(), crate::ptx_cache::CacheError> {
        let path = self.cache.dir.join(self.file_name(key));
        let text = format_choice(choice, &self.device, &key_line(key));
        self.cache.store_file(&path, text.as_bytes())
    }

    /// `cudnn-{md5 of device and key}.txt`.
    fn file_name(&self, key: &ConvKey) -> String {
        format!("cudnn-{}.txt", md5_hex(&[&self.device, &key_line(key)]))
    }
}

/// The key as its file states it.
fn key_line(key: &ConvKey) -> String {
    let shape: Vec<String> = key.shape.iter().map(usize::to_string).collect();
    format!(
        "shape {} precision {:?} deterministic {}",
        shape.join(" "),
        key.precision,
        key.deterministic
    )
}

/// Whether `settings` still admit every algorithm of `choice` (the rules of [`choose`]).
fn admitted(choice: &StoredChoice, settings: AlgorithmSettings) -> bool {
    fn one<A: DeterministicOrder>(candidate: Candidate<A>, settings: AlgorithmSettings) -> bool {
        choose(
            &[candidate],
            settings.precision,
            settings.deterministic,
            WORKSPACE_LIMIT,
        )
        .is_ok()
    }
    one(choice.forward, settings)
        && choice
            .backward
            .is_none_or(|backward| one(backward.data, settings) && one(backward.filter, settings))
}

/// The file's text: the header, the device, the key, then one line per direction.
fn format_choice(choice: &StoredChoice, device: &str, key: &str) -> String {
    let mut text = format!("{HEADER}\ndevice {device}\nkey {key}\n");
    text += &direction_line("forward", &choice.forward);
    if let Some(backward) = &choice.backward {
        text += &direction_line("backward-data", &backward.data);
        text += &direction_line("backward-filter", &backward.filter);
    }
    text
}

/// `{direction} {algo} {math} {memory} {time_ms} {deterministic}` and a newline.
fn direction_line<A: Numbered>(direction: &str, candidate: &Candidate<A>) -> String {
    format!(
        "{direction} {} {} {} {:?} {}\n",
        candidate.algo.number(),
        candidate.math as u32,
        candidate.memory,
        candidate.time_ms,
        candidate.deterministic
    )
}

/// The choice of a file's `text` written for `device` and `key`; `None` when any line is not
/// what [`format_choice`] writes.
fn parse(text: &str, device: &str, key: &str) -> Option<StoredChoice> {
    let mut lines = text.lines();
    if lines.next()? != HEADER
        || lines.next()?.strip_prefix("device ")? != device
        || lines.next()?.strip_prefix("key ")? != key
    {
        return None;
    }
    let forward = candidate(lines.next()?, "forward")?;
    let backward = match lines.next() {
        None => None,
        Some(data) => Some(BackwardAlgorithms {
            data: candidate(data, "backward-data")?,
            filter: candidate(lines.next()?, "backward-filter")?,
        }),
    };
    lines
        .next()
        .is_none()
        .then_some(StoredChoice { forward, backward })
}

/// One direction's line, as [`direction_line`] writes it.
fn candidate<A: Numbered>(line: &str, direction: &str) -> Option<Candidate<A>> {
    let mut fields = line.split(' ');
    if fields.next()? != direction {
        return None;
    }
    let algo = A::from_number(fields.next()?.parse().ok()?)?;
    let math = math_from_number(fields.next()?.parse().ok()?)?;
    let memory = fields.next()?.parse().ok()?;
    let time_ms = fields.next()?.parse().ok()?;
    let deterministic = fields.next()?.parse().ok()?;
    fields.next().is_none().then_some(Candidate {
        algo,
        status: sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
        time_ms,
        memory,
        deterministic,
        math,
    })
}

/// An algorithm enumeration of cuDNN's read back from its number: only a value it defines.
trait Numbered: DeterministicOrder + 'static {
    /// Every value (without the `COUNT` sentinel).
    const ALL: &'static [Self];
    /// The value numbered `number`, if there is one.
    fn from_number(number: u32) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|value| value.number() == number)
    }
}

impl Numbered for sys::cudnnConvolutionFwdAlgo_t {
    const ALL: &'static [Self] = {
        use sys::cudnnConvolutionFwdAlgo_t::*;
        &[
            CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
            CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
            CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
            CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
            CUDNN_CONVOLUTION_FWD_ALGO_FFT,
            CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
            CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
            CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
        ]
    };
}

impl Numbered for sys::cudnnConvolutionBwdDataAlgo_t {
    const ALL: &'static [Self] = {
        use sys::cudnnConvolutionBwdDataAlgo_t::*;
        &[
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
        ]
    };
}

impl Numbered for sys::cudnnConvolutionBwdFilterAlgo_t {
    const ALL: &'static [Self] = {
        use sys::cudnnConvolutionBwdFilterAlgo_t::*;
        &[
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        ]
    };
}

/// The math type numbered `number`, if cuDNN defines one.
fn math_from_number(number: u32) -> Option<sys::cudnnMathType_t> {
    use sys::cudnnMathType_t::*;
    [
        CUDNN_DEFAULT_MATH,
        CUDNN_TENSOR_OP_MATH,
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CUDNN_FMA_MATH,
    ]
    .into_iter()
    .find(|math| *math as u32 == number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Precision;
    use sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
    use sys::cudnnConvolutionBwdFilterAlgo_t::{
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
    };
    use sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
    use sys::cudnnMathType_t::{CUDNN_FMA_MATH, CUDNN_TENSOR_OP_MATH};

    const DEVICE: &str = "NVIDIA H200 sm_90 driver 13.0 cudnn 9.26.0";

    fn key(deterministic: bool) -> ConvKey {
        ConvKey {
            shape: [256, 32, 32, 16, 32, 3, 1, 1],
            precision: Precision::Tf32,
            deterministic,
        }
    }

    fn settings(deterministic: bool) -> AlgorithmSettings {
        AlgorithmSettings {
            precision: Precision::Tf32,
            deterministic,
        }
    }

    fn measured<A>(algo: A, math: sys::cudnnMathType_t, deterministic: bool) -> Candidate<A> {
        Candidate {
            algo,
            status: sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
            time_ms: 0.123_456_79,
            memory: 4_718_592,
            deterministic,
            math,
        }
    }

    fn forward_only() -> StoredChoice {
        StoredChoice {
            forward: measured(
                CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                CUDNN_TENSOR_OP_MATH,
                true,
            ),
            backward: None,
        }
    }

    fn with_backward(filter_deterministic: bool) -> StoredChoice {
        let filter = match filter_deterministic {
            true => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            false => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        };
        StoredChoice {
            backward: Some(BackwardAlgorithms {
                data: measured(CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, CUDNN_FMA_MATH, true),
                filter: measured(filter, CUDNN_TENSOR_OP_MATH, filter_deterministic),
            }),
            ..forward_only()
        }
    }

    fn store() -> (tempfile::TempDir, AlgorithmStore) {
        let folder = tempfile::tempdir().unwrap();
        let cache = PtxCache::new(folder.path().join("ptx"));
        (folder, AlgorithmStore::new(cache, DEVICE.to_string()))
    }

    #[test]
    fn a_saved_choice_loads_back_equal_with_and_without_its_backward_directions() {
        let (_folder, store) = store();
        for choice in [forward_only(), with_backward(true)] {
            store.save(&key(true), &choice).unwrap();
            assert_eq!(store.load(&key(true), settings(true)), Some(choice));
        }
        let text = std::fs::read_to_string(store.cache.dir.join(store.file_name(&key(true))));
        assert_eq!(
            text.unwrap(),
            format!(
                "{HEADER}\ndevice {DEVICE}\nkey shape 256 32 32 16 32 3 1 1 precision Tf32 \
                 deterministic true\nforward 1 1 4718592 0.12345679 true\n\
                 backward-data 1 3 4718592 0.12345679 true\n\
                 backward-filter 1 1 4718592 0.12345679 true\n"
            )
        );
    }

    #[test]
    fn another_device_or_key_misses() {
        let (folder, store) = store();
        store.save(&key(false), &forward_only()).unwrap();
        let other_gpu = AlgorithmStore::new(
            PtxCache::new(folder.path().join("ptx")),
            "NVIDIA H100 sm_90 driver 13.0 cudnn 9.26.0".to_string(),
        );
        assert_eq!(other_gpu.load(&key(false), settings(false)), None);
        let mut other_shape = key(false);
        other_shape.shape[0] = 16;
        assert_eq!(store.load(&other_shape, settings(false)), None);
        assert_eq!(
            store.load(&key(false), settings(false)),
            Some(forward_only())
        );
    }

    #[test]
    fn a_file_that_does_not_read_back_whole_misses() {
        let (_folder, store) = store();
        let choice = with_backward(true);
        let good = format_choice(&choice, DEVICE, &key_line(&key(true)));
        assert_eq!(parse(&good, DEVICE, &key_line(&key(true))), Some(choice));
        let spoiled = [
            String::new(),
            good.replacen("forward 1 ", "forward 8 ", 1), // the COUNT sentinel, not an algorithm
            good.replacen("forward 1 1 ", "forward 1 7 ", 1), // no such math type
            good.replacen(" 4718592 ", " -1 ", 1),
            good.replacen("0.12345679 true\n", "0.12345679 yes\n", 1),
            good.replacen("backward-data", "backward-filter", 1),
            good.lines().take(5).collect::<Vec<_>>().join("\n"), // the filter's line cut off
            format!("{good}forward 1 1 0 0.5 true\n"),
            good.replacen(HEADER, "tandem cudnn algorithms 2", 1),
        ];
        for text in spoiled {
            assert_eq!(parse(&text, DEVICE, &key_line(&key(true))), None, "{text}");
        }
        std::fs::create_dir_all(&store.cache.dir).unwrap();
        let path = store.cache.dir.join(store.file_name(&key(true)));
        std::fs::write(&path, &good[..good.len() / 2]).unwrap();
        assert_eq!(store.load(&key(true), settings(true)), None);
    }

    #[test]
    fn a_choice_the_settings_refuse_misses() {
        let (_folder, store) = store();
        // A non-deterministic filter algorithm under a key of deterministic mode: not what
        // measuring would choose, so not used.
        store.save(&key(true), &with_backward(false)).unwrap();
        assert_eq!(store.load(&key(true), settings(true)), None);
        store.save(&key(false), &with_backward(false)).unwrap();
        assert_eq!(
            store.load(&key(false), settings(false)),
            Some(with_backward(false))
        );
    }

    #[test]
    fn a_folder_that_cannot_be_written_is_an_error_naming_it() {
        let folder = tempfile::tempdir().unwrap();
        let file = folder.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        let store = AlgorithmStore::new(PtxCache::new(file.join("ptx")), DEVICE.to_string());
        let error = store.save(&key(true), &forward_only()).unwrap_err();
        assert!(error.to_string().contains("a-file/ptx"), "{error}");
        assert_eq!(store.load(&key(true), settings(true)), None);
    }
}
