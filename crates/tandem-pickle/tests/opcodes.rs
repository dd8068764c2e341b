//! The stack machine on hand-assembled pickle programs: each opcode family, the memo, and
//! every kind of bad input ending in an error that names the byte offset.

use tandem_pickle::{loads, PickleError, Value};

/// Assembles a pickle program from opcode bytes and arguments.
#[derive(Default)]
struct Program(Vec<u8>);

impl Program {
    fn protocol(protocol: u8) -> Program {
        Program(vec![0x80, protocol])
    }
    fn op(mut self, opcode: u8) -> Program {
        self.0.push(opcode);
        self
    }
    fn bytes(mut self, bytes: &[u8]) -> Program {
        self.0.extend_from_slice(bytes);
        self
    }
    fn short_binstring(self, text: &str) -> Program {
        self.op(b'U')
            .bytes(&[text.len() as u8])
            .bytes(text.as_bytes())
    }
    fn binunicode(self, text: &str) -> Program {
        self.op(b'X')
            .bytes(&(text.len() as u32).to_le_bytes())
            .bytes(text.as_bytes())
    }
    fn short_binunicode(self, text: &str) -> Program {
        self.op(0x8c)
            .bytes(&[text.len() as u8])
            .bytes(text.as_bytes())
    }
    fn binint1(self, value: u8) -> Program {
        self.op(b'K').bytes(&[value])
    }
    fn binput(self, index: u8) -> Program {
        self.op(b'q').bytes(&[index])
    }
    fn binget(self, index: u8) -> Program {
        self.op(b'h').bytes(&[index])
    }
    fn stop(self) -> Vec<u8> {
        self.op(b'.').0
    }
}

fn text(value: &str) -> Value {
    Value::String(value.to_string())
}

#[test]
fn scalars_of_every_width() {
    let program = Program::protocol(2)
        .op(b'(')
        .op(b'N')
        .op(0x88)
        .op(0x89)
        .binint1(200)
        .op(b'M')
        .bytes(&60000u16.to_le_bytes())
        .op(b'J')
        .bytes(&(-123456i32).to_le_bytes())
        .op(0x8a)
        .bytes(&[2, 0x00, 0x80]) // LONG1: -32768
        .op(0x8a)
        .bytes(&[0])
        .op(0x8b)
        .bytes(&9i32.to_le_bytes())
        .bytes(&[1, 0, 0, 0, 0, 0, 0, 0, 1]) // LONG4: 2^64 + 1, wider than i64
        .op(b'G')
        .bytes(&1.5f64.to_be_bytes())
        .op(b't')
        .stop();
    let value = loads(&program).unwrap();
    assert_eq!(
        value,
        Value::Tuple(vec![
            Value::None,
            Value::Bool(true),
            Value::Bool(false),
            Value::Int(200),
            Value::Int(60000),
            Value::Int(-123456),
            Value::Int(-32768),
            Value::Int(0),
            Value::BigInt(vec![1, 0, 0, 0, 0, 0, 0, 0, 1]),
            Value::Float(1.5),
        ])
    );
}

#[test]
fn strings_bytes_and_python2_str() {
    let program = Program::protocol(4)
        .op(0x95)
        .bytes(&100u64.to_le_bytes()[..]) // FRAME longer than what follows is an error...
        .stop();
    let error = loads(&program).unwrap_err();
    assert!(
        matches!(
            error,
            PickleError::Truncated {
                what: "FRAME contents",
                ..
            }
        ),
        "{error}"
    );

    let program = Program::protocol(4)
        .op(b'(')
        .short_binstring("py2")
        .op(b'T')
        .bytes(&3i32.to_le_bytes())
        .bytes(b"abc")
        .op(b'C')
        .bytes(&[2, 0xff, 0x00])
        .op(b'B')
        .bytes(&1u32.to_le_bytes())
        .bytes(b"z")
        .op(0x8e)
        .bytes(&2u64.to_le_bytes())
        .bytes(b"yy")
        .op(0x96)
        .bytes(&1u64.to_le_bytes())
        .bytes(b"q")
        .short_binunicode("héllo")
        .binunicode("wide")
        .op(0x8d)
        .bytes(&2u64.to_le_bytes())
        .bytes(b"u8")
        .op(b'l')
        .stop();
    assert_eq!(
        loads(&program).unwrap(),
        Value::List(vec![
            Value::Bytes(b"py2".to_vec()),
            Value::Bytes(b"abc".to_vec()),
            Value::Bytes(vec![0xff, 0x00]),
            Value::Bytes(b"z".to_vec()),
            Value::Bytes(b"yy".to_vec()),
            Value::ByteArray(b"q".to_vec()),
            text("héllo"),
            text("wide"),
            text("u8"),
        ])
    );
}

#[test]
fn containers_and_memo_sharing_a_dict_filled_after_it_was_memoized() {
    // d = {}; memo[0] = d; d['k'] = [1, 2]; result = (d, d) with d read back from the memo.
    let program = Program::protocol(2)
        .op(b'}')
        .binput(0)
        .short_binunicode("k")
        .op(b']')
        .op(0x94) // MEMOIZE as index 1
        .op(b'(')
        .binint1(1)
        .binint1(2)
        .op(b'e')
        .op(b's')
        .binget(0)
        .op(0x86)
        .stop();
    let value = loads(&program).unwrap();
    let dict = Value::Dict(vec![(
        text("k"),
        Value::List(vec![Value::Int(1), Value::Int(2)]),
    )]);
    assert_eq!(value, Value::Tuple(vec![dict.clone(), dict]));
}

#[test]
fn sets_frozensets_dup_pop_and_long_memo() {
    // A set {3, 4} memoized at 70000, a frozenset {5}, the set read back and duplicated.
    let sets = |program: Program| {
        program
            .op(0x8f)
            .op(b'(')
            .binint1(3)
            .binint1(4)
            .op(0x90)
            .op(b'r')
            .bytes(&70000u32.to_le_bytes())
            .op(b'(')
            .binint1(5)
            .op(0x91)
            .binint1(9)
            .op(b'0') // POP the 9
            .op(b'j')
            .bytes(&70000u32.to_le_bytes())
            .op(b'2') // DUP
            .op(b'(')
            .binint1(7)
            .op(b'1') // POP_MARK drops the 7
    };
    let program = sets(Program::protocol(4))
        .op(b')')
        .op(b'\x85')
        .op(b'(')
        .op(b'N')
        .op(b'N')
        .op(b'd')
        .op(b'(')
        .op(b't')
        .op(b't')
        .stop();
    // The final TUPLE has no MARK left below it except the first... build it explicitly:
    let error = loads(&program).unwrap_err();
    assert!(
        error.to_string().contains("TUPLE without a MARK"),
        "{error}"
    );

    let program = sets(Program::protocol(4).op(b'('))
        .op(b'(')
        .op(b'N')
        .op(b'N')
        .op(b'd')
        .op(b't')
        .stop();
    let set = Value::Set(vec![Value::Int(3), Value::Int(4)]);
    assert_eq!(
        loads(&program).unwrap(),
        Value::Tuple(vec![
            set.clone(),
            Value::Set(vec![Value::Int(5)]),
            set.clone(),
            set,
            Value::Dict(vec![(Value::None, Value::None)]),
        ])
    );
}

#[test]
fn globals_reduce_build_newobj_and_persistent_ids_stay_opaque() {
    let program = Program::protocol(4)
        .op(b'c')
        .bytes(b"collections\nOrderedDict\n")
        .op(b')')
        .op(b'R')
        .op(b'(')
        .short_binunicode("a")
        .binint1(1)
        .op(b'u')
        .op(b'}')
        .op(b'b')
        .short_binunicode("mod.sub")
        .short_binunicode("Cls")
        .op(0x93)
        .binint1(5)
        .op(0x85)
        .op(0x81)
        .op(b'a') // APPEND onto an object: list_items
        .short_binunicode("key")
        .op(b'Q')
        .op(0x86)
        .stop();
    let value = loads(&program).unwrap();
    let Value::Tuple(items) = &value else {
        panic!("expected a tuple, found {value:?}")
    };
    let ordered = &items[0];
    assert_eq!(ordered.get("a"), Some(&Value::Int(1)));
    match ordered {
        Value::Object {
            state, list_items, ..
        } => {
            assert_eq!(state.as_deref(), Some(&Value::Dict(Vec::new())));
            assert_eq!(
                list_items,
                &vec![Value::Object {
                    callable: Box::new(Value::Global {
                        module: "mod.sub".to_string(),
                        name: "Cls".to_string()
                    }),
                    args: Box::new(Value::Tuple(vec![Value::Int(5)])),
                    state: None,
                    list_items: Vec::new(),
                    dict_items: Vec::new(),
                }]
            );
        }
        other => panic!("expected an object, found {other:?}"),
    }
    assert_eq!(items[1], Value::PersistentId(Box::new(text("key"))));
}

#[test]
fn truncated_input_names_offset_and_what_was_missing() {
    let full = Program::protocol(2).short_binstring("abcdef").stop();
    let cut = &full[..6];
    match loads(cut).unwrap_err() {
        PickleError::Truncated {
            offset,
            needed,
            what,
        } => {
            assert_eq!((offset, needed), (6, 4));
            assert_eq!(what, "SHORT_BINSTRING/SHORT_BINBYTES data");
        }
        other => panic!("expected Truncated, found {other}"),
    }
    let error = loads(&full[..full.len() - 1]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "pickle truncated at byte 10: expected 1 more bytes for an opcode"
    );
}

#[test]
fn huge_declared_lengths_fail_without_allocating() {
    let program = Program::protocol(4)
        .op(0x8e)
        .bytes(&(u64::MAX / 2).to_le_bytes())
        .bytes(b"tiny")
        .stop();
    let error = loads(&program).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "pickle truncated at byte 16: expected {} more bytes for BINBYTES8 data",
            u64::MAX / 2 - 5
        )
    );
    let negative = Program::protocol(2)
        .op(b'T')
        .bytes(&(-5i32).to_le_bytes())
        .stop();
    assert_eq!(
        loads(&negative).unwrap_err().to_string(),
        "pickle byte 2: BINSTRING length is negative (-5)"
    );
}

#[test]
fn structural_errors_name_the_opcode_offset() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            Program::protocol(2).op(b'a').stop(),
            "pickle byte 2: APPEND found an empty stack",
        ),
        (
            Program::protocol(2).binint1(1).op(b'e').stop(),
            "pickle byte 4: APPENDS without a MARK",
        ),
        (
            Program::protocol(2).binint1(1).binint1(2).op(b'a').stop(),
            "pickle byte 6: APPEND/APPENDS expects a list or an object",
        ),
        (
            Program::protocol(2).binget(7).stop(),
            "pickle byte 2: memo GET of index 7, which was never PUT",
        ),
        (
            Program::protocol(6).stop(),
            "pickle byte 0: protocol 6, expected at most 5",
        ),
        (
            Program::protocol(2).op(b'(').binint1(1).op(b'd').stop(),
            "pickle byte 5: DICT expects key/value pairs, found an odd count of 1 items",
        ),
        (
            Program::protocol(2).op(b'N').binint1(1).op(b'R').stop(),
            "pickle byte 5: REDUCE/NEWOBJ expects a tuple of arguments",
        ),
        (
            Program::protocol(2).op(b'I').stop(),
            "pickle byte 2: unsupported opcode 0x49 (INT (protocol 0))",
        ),
        (
            Program::protocol(5).op(0x97).stop(),
            "pickle byte 2: unsupported opcode 0x97 (NEXT_BUFFER (out-of-band buffers))",
        ),
        (
            Program::protocol(2).op(0xff).stop(),
            "pickle byte 2: unsupported opcode 0xff (unknown)",
        ),
        (
            Program::protocol(2).op(b'(').op(b'.').0,
            "pickle byte 3: STOP found an empty stack",
        ),
        (
            Program::protocol(2).op(0x8c).bytes(&[2, 0xc3, 0x28]).stop(),
            "pickle byte 4: unicode string is not valid UTF-8",
        ),
    ];
    for (program, expected) in cases {
        let error = loads(&program).unwrap_err();
        assert_eq!(error.to_string(), expected, "program {program:?}");
    }
}

#[test]
fn recursive_and_deeply_nested_values_hit_the_depth_limit() {
    // l = []; l.append(l)
    let recursive = Program::protocol(2)
        .op(b']')
        .binput(0)
        .binget(0)
        .op(b'a')
        .stop();
    let error = loads(&recursive).unwrap_err();
    assert!(
        matches!(error, PickleError::LimitExceeded { .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("nested deeper than 200 levels"),
        "{error}"
    );

    let mut nested = Program::protocol(2);
    for _ in 0..1000 {
        nested = nested.op(b']');
    }
    for _ in 0..999 {
        nested = nested.op(b'a');
    }
    let error = loads(&nested.stop()).unwrap_err();
    assert!(
        error.to_string().contains("nested deeper than 200 levels"),
        "{error}"
    );
}

#[test]
fn shared_references_cannot_blow_up_the_output() {
    // Each level is a 2-tuple of the previous level: 2^40 leaves from ~200 bytes.
    let mut program = Program::protocol(2).short_binunicode("leaf");
    for _ in 0..40 {
        program = program.op(b'2').op(0x86);
    }
    let error = loads(&program.stop()).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("pickle exceeds a limit: more than"),
        "{error}"
    );
}
